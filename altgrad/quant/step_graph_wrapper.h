// What a step graph's C++ wrapper includes, precompiled as one header (altgrad/quant/wrapper_headers.py).
// Inductor precompiles only the first of these; the rest come with the ATen ops the wrapper calls
// through the boxed dispatcher (layer norm, GELU, arange: their schemas hold a list, a string or
// an optional dtype) and were parsed anew for every graph, ~half of each wrapper's g++ time.
#include <torch/csrc/inductor/cpp_wrapper/cpu.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
