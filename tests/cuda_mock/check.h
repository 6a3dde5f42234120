// CHECK for the mock drivers (stress.cpp, graph_stress.cpp, ring_cycle.cpp): a failed condition is
// printed with its place and counted in check_failures (any thread); the driver's exit status
// reports the count.
#pragma once

#include <atomic>
#include <cstdio>

inline std::atomic<int> check_failures{0};

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
      check_failures++;                                         \
    }                                                           \
  } while (0)
