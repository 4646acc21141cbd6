# ctest driver: install gwt from the build tree, then configure, build and run the consumer.
# Inputs: GWT_BINARY_DIR, GWT_SOURCE_DIR, WORK_DIR, TORCH_DIR, MODE (package|subdirectory),
#         GENERATOR, LAUNCHER (compiler launcher, may be empty).
file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix_path "")
if(MODE STREQUAL "package")
  execute_process(COMMAND "${CMAKE_COMMAND}" --install "${GWT_BINARY_DIR}" --prefix "${WORK_DIR}/prefix"
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "cmake --install failed: ${rc}")
  endif()
  set(prefix_path "${WORK_DIR}/prefix")
  # The public headers are installed; the kernels' internal interface (src/kernels/kernels.h) is not.
  foreach(header gwt.h cuda.h optim/wavelet_adam.h)
    if(NOT EXISTS "${prefix_path}/include/gwt/${header}")
      message(FATAL_ERROR "cmake --install did not install gwt/${header}")
    endif()
  endforeach()
  file(GLOB_RECURSE internal "${prefix_path}/include/*kernels.h")
  if(internal)
    message(FATAL_ERROR "cmake --install installed the internal ${internal}")
  endif()
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" -S "${GWT_SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/build"
                        -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${prefix_path}" "-DTorch_DIR=${TORCH_DIR}" -DGWT_CONSUME=${MODE}
                        "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}"
                        "-DGWT_SOURCE_DIR=${GWT_SOURCE_DIR}" -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer (${MODE}) failed: ${rc}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer (${MODE}) failed: ${rc}")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer (${MODE}) failed: ${rc}")
endif()
