// Catch2 2.x and 3.x differ in header names and the substring matcher.
#pragma once

#ifdef KVCACHE_CATCH2_V3
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#define KV_CONTAINS(text) Catch::Matchers::ContainsSubstring(text)
#else
#include <catch2/catch.hpp>
#define KV_CONTAINS(text) Catch::Matchers::Contains(text)
#endif
