// The op library is compiled with hidden visibility (only the C++ API below
// is its ABI); KVCACHE_API marks what it exports.
#pragma once

#if defined(_WIN32)
#define KVCACHE_API __declspec(dllexport)
#else
#define KVCACHE_API __attribute__((visibility("default")))
#endif
