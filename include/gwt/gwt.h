#pragma once

/// \file
/// Umbrella header of gwt: wavelet-compressed Adam for LibTorch.

#include "gwt/optim/param_groups.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/transform.h"
#include "gwt/version.h"
#include "gwt/wavelet.h"
