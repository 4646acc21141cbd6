"""gwt: wavelet-compressed Adam (GWT, arXiv 2501.07237) for PyTorch.

The optimizers and transforms of gwt's C++ library, bound for Python::

    import gwt
    # was torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-8)
    opt = gwt.WaveletAdam(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-8,
                          norm_growth_limit=0)

gwt.WaveletAdam's own defaults differ from AdamW's (weight_decay 0, eps 1e-6, norm-growth limiter
on): pass AdamW's, as here, where they are meant. See README.md (python/) for the options and what
is exact to what.
"""

import torch  # (loads LibTorch before the extension module)

try:
    from . import _C
except ImportError as error:  # most often: built against another torch than this one
    raise ImportError(
        f"gwt: its extension module gwt._C did not load ({error}). It must be built against the "
        f"torch it runs with (this is torch {torch.__version__}): rebuild it in this environment "
        "with `pip install --no-build-isolation ./python`") from error
if _C._torch_version != torch.__version__:
    raise ImportError(
        f"gwt: built against torch {_C._torch_version} but this is torch {torch.__version__}; "
        "rebuild it in this environment with `pip install --no-build-isolation ./python`")

from . import nn
from .optim import FoamAdam, GaLoreAdam, WaveletAdam
from .param_groups import (HEAD_NAMES, ParamAssignment, assign_param_groups, foam_param_groups,
                           paper_param_groups)
from .transform import (dwt, dwt_max_level, idwt, modes, threshold, wavedec, wavedec2,
                        wavelet_filters, wavelets, waverec, waverec2)

__version__ = _C.__version__

__all__ = [
    "nn",
    "WaveletAdam",
    "GaLoreAdam",
    "FoamAdam",
    "paper_param_groups",
    "foam_param_groups",
    "assign_param_groups",
    "ParamAssignment",
    "HEAD_NAMES",
    "wavelets",
    "modes",
    "wavelet_filters",
    "dwt_max_level",
    "dwt",
    "idwt",
    "wavedec",
    "waverec",
    "wavedec2",
    "waverec2",
    "threshold",
]

# The DDP communication hook (gwt.distributed) needs torch.distributed, which some torch builds
# leave out.
if torch.distributed.is_available():
    from . import distributed  # noqa: E402

    __all__.append("distributed")
