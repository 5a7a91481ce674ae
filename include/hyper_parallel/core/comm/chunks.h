#pragma once
// torch.chunk arithmetic, the one place it is written: `global` items cut into `parts` pieces of
// ceil(global / parts), the last pieces smaller or empty. E.g. (5, 4) -> sizes 2, 2, 1, 0 at
// offsets 0, 2, 4, 5. Shards of a DTensor, a rank's block of a collective and the chunks of a
// block all follow it.

#include <cstdint>
#include <vector>

namespace hyper_parallel::comm {

/// Size of piece `index` (0 <= index < parts).
int64_t chunk_size(int64_t global, int64_t parts, int64_t index);
/// First item of piece `index`.
int64_t chunk_offset(int64_t global, int64_t parts, int64_t index);
/// Sizes of all `parts` pieces.
std::vector<int64_t> chunk_sizes(int64_t global, int64_t parts);

}  // namespace hyper_parallel::comm
