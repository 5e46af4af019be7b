// Minimal assertion helpers for the torch-free core unit tests (no test framework needed).
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

#define CHECK_THROWS(expr)                                                                   \
  do {                                                                                       \
    bool threw_ = false;                                                                     \
    try {                                                                                    \
      expr;                                                                                  \
    } catch (...) {                                                                          \
      threw_ = true;                                                                         \
    }                                                                                        \
    if (!threw_) {                                                                           \
      std::fprintf(stderr, "%s:%d: expected an exception: %s\n", __FILE__, __LINE__, #expr); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)
