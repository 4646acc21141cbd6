#pragma once

/// \file
/// gwt's version (kept equal to project(VERSION) in CMakeLists.txt).

#define GWT_VERSION_MAJOR 0
#define GWT_VERSION_MINOR 1
#define GWT_VERSION_PATCH 0

namespace gwt {
/// "major.minor.patch"
inline constexpr const char* version = "0.1.0";
}  // namespace gwt
