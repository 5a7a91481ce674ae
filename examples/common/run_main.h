#pragma once
// main() of the examples and benchmarks: an error (a c10::Error or any std::exception) becomes one
// line "program: message" on stderr and exit status 1, instead of an abort with a backtrace.
// hp-run then names the rank that failed.
//
// Usage:
//   int main(int argc, char** argv) {
//     return hp_examples::run_main("llama3_train", [&] { ...; return 0; });
//   }

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace hp_examples {

inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

template <typename Body>
int run_main(const char* program, Body&& body) {
  std::string message;
  try {
    return body();
  } catch (const c10::Error& e) {
    message = first_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    message = first_line(e.what());
  }
  std::fprintf(stderr, "%s: %s\n", program, message.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  // Skip destructors: after a failed collective, transfers may still be in flight, and tearing
  // the process group down must not wait for peers that will never answer.
  std::_Exit(1);
}

}  // namespace hp_examples
