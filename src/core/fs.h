// Small filesystem helpers shared by every layer that writes files (run directories,
// checkpoints, configs). Errors throw fp8rl::Error naming the path and the OS reason.
#pragma once
#include <string>
#include <string_view>

namespace fp8rl {

// Writes `bytes` to `path` so that a reader (or a crash) sees either the old file or the
// complete new one, never a torn mix: write to a temporary file in the same directory,
// fsync it, rename it over `path`, then fsync the directory. The parent must exist.
void write_file_atomic(const std::string& path, std::string_view bytes);

// The whole file as bytes; throws when it cannot be opened or read.
std::string read_file(const std::string& path);

// Creates `path` and its missing parents (no error when it already is a directory).
void make_dirs(const std::string& path);

}  // namespace fp8rl
