# kvcache_link_ops(<target>): links <target> against the kvcache op library so
# that its operators register even when the program calls them only through
# the dispatcher (TorchScript, AOTInductor, torch::jit). Such a program
# references no kvcache symbol, and a linker that drops unreferenced shared
# libraries (--as-needed, the default on Debian/Ubuntu) would leave
# libkvcache.so out: its TORCH_LIBRARY initializers would never run.
#
# Used by CMakeLists.txt (in-tree target kvcache::kvcache) and shipped in the
# wheel with kvcacheConfig.cmake (the imported target of the same name).
function(kvcache_link_ops target)
  target_link_libraries(${target} PRIVATE -Wl,--no-as-needed kvcache::kvcache -Wl,--as-needed)
endfunction()
