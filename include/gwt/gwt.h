#pragma once

/// \file
/// Umbrella header of gwt: wavelet-compressed Adam for LibTorch.

#include "gwt/compression.h"
#include "gwt/cuda.h"
#include "gwt/nn/delta_linear.h"
#include "gwt/nn/low_rank_linear.h"
#include "gwt/nn/rank_schedule.h"
#include "gwt/optim/foam_adam.h"
#include "gwt/optim/galore_adam.h"
#include "gwt/optim/param_groups.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/transform.h"
#include "gwt/version.h"
#include "gwt/wavelet.h"
