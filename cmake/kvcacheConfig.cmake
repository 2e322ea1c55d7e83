# CMake package config for an installed kvcache wheel (site-packages/kvcache):
#
#   find_package(kvcache REQUIRED)   # finds Torch too
#   target_link_libraries(app PRIVATE kvcache::kvcache)   # calls kvcache:: functions
#   kvcache_link_ops(app)            # or: reaches the ops only through the dispatcher
#
# with -DCMAKE_PREFIX_PATH=<site-packages>/kvcache (python -c 'import os, kvcache;
# print(os.path.dirname(kvcache.__file__))'). Gives the imported target
# kvcache::kvcache (libkvcache.so, the headers in kvcache/include, and Torch)
# and kvcache_link_ops(<target>). This file lives in
# kvcache/share/cmake/kvcache/; everything is found relative to it.
cmake_minimum_required(VERSION 3.19)  # string(JSON)
include(CMakeFindDependencyMacro)

get_filename_component(_kvcache_root "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

# Torch: the torch installed beside kvcache (the one it was built against)
# unless the caller already found or pointed at one.
if(NOT TARGET torch)
  # torch's wheels link kineto into libtorch_cpu.so, but TorchConfig.cmake
  # looks for a separate libkineto and warns when it is missing: point that
  # search at libtorch_cpu.so, which Torch links anyway (no warning).
  if(NOT DEFINED kineto_LIBRARY AND EXISTS "${_kvcache_root}/../torch/lib/libtorch_cpu.so"
     AND NOT EXISTS "${_kvcache_root}/../torch/lib/libkineto.a")
    get_filename_component(_kvcache_torch_cpu "${_kvcache_root}/../torch/lib/libtorch_cpu.so" ABSOLUTE)
    set(kineto_LIBRARY "${_kvcache_torch_cpu}" CACHE FILEPATH "kineto is inside libtorch_cpu.so in torch's wheels")
  endif()
  find_dependency(Torch HINTS "${_kvcache_root}/../torch/share/cmake")
endif()

if(NOT TARGET kvcache::kvcache)
  if(NOT EXISTS "${_kvcache_root}/libkvcache.so" OR NOT EXISTS "${_kvcache_root}/include/kvcache/kvcache.h")
    set(kvcache_FOUND FALSE)
    set(kvcache_NOT_FOUND_MESSAGE
        "kvcache at ${_kvcache_root} has no libkvcache.so or include/kvcache/kvcache.h (not a built package)")
    return()
  endif()
  # The C++ standard kvcache was built with (torch's headers need it too).
  file(READ "${CMAKE_CURRENT_LIST_DIR}/build_settings.json" _kvcache_settings)
  string(JSON _kvcache_std GET "${_kvcache_settings}" cxx_standard)
  add_library(kvcache::kvcache SHARED IMPORTED)
  set_target_properties(kvcache::kvcache PROPERTIES
    IMPORTED_LOCATION "${_kvcache_root}/libkvcache.so"
    IMPORTED_SONAME "libkvcache.so"
    INTERFACE_INCLUDE_DIRECTORIES "${_kvcache_root}/include"
    INTERFACE_COMPILE_FEATURES "cxx_std_${_kvcache_std}"
    INTERFACE_LINK_LIBRARIES "${TORCH_LIBRARIES}")
  unset(_kvcache_settings)
  unset(_kvcache_std)
endif()

include("${CMAKE_CURRENT_LIST_DIR}/kvcache_link_ops.cmake")
set(kvcache_INCLUDE_DIRS "${_kvcache_root}/include")
set(kvcache_LIBRARY "${_kvcache_root}/libkvcache.so")
unset(_kvcache_root)
