#include "write_shards.h"

#include <filesystem>

#include <c10/util/Exception.h>

#include "file_io.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint::detail {

std::string rank_file_name(int64_t rank) { return "rank" + std::to_string(rank) + ".safetensors"; }

std::vector<at::Tensor> tensors_to_write(const State& state, const SavePlan& plan) {
  std::vector<at::Tensor> data;
  for (size_t i : plan.mine) {
    const auto& entry = (state.begin() + static_cast<std::ptrdiff_t>(i))->second;
    data.push_back(entry.local.detach().cpu().contiguous());
  }
  return data;
}

std::vector<ShardInfo> write_rank_file(const char* fn, const std::string& path, const SavePlan& plan,
                                       const std::vector<at::Tensor>& data, int64_t rank, int64_t step,
                                       bool durable, const std::function<void()>& halfway) {
  TORCH_INTERNAL_ASSERT(data.size() == plan.mine.size(), "write_rank_file: one tensor per region");
  std::vector<TensorRecord> records;
  int64_t offset = 0;
  for (size_t j = 0; j < data.size(); ++j) {
    const size_t i = plan.mine[j];
    const int64_t nbytes = data[j].numel() * static_cast<int64_t>(data[j].element_size());
    records.push_back(
        {plan.keys[i].first, plan.keys[i].second.dtype, plan.regions[i].shape, offset, offset + nbytes});
    offset += nbytes;
  }
  const std::string header = encode_header(records, {{"format", "hyper_parallel.checkpoint"},
                                                     {"rank", std::to_string(rank)},
                                                     {"step", std::to_string(step)}});
  auto file = File::create(fn, path);
  file.write_all(header.data(), static_cast<int64_t>(header.size()));
  const auto start = static_cast<int64_t>(header.size());
  const auto name = std::filesystem::path(path).filename().string();
  std::vector<ShardInfo> written;
  for (size_t j = 0; j < records.size(); ++j) {
    if (j == records.size() / 2 && halfway) halfway();
    const int64_t nbytes = records[j].end - records[j].begin;
    file.write_all(data[j].data_ptr(), nbytes);
    count_written(nbytes);
    written.push_back({name, records[j].name, plan.regions[plan.mine[j]], start + records[j].begin,
                       start + records[j].end, crc32_update(0, data[j].data_ptr(), nbytes)});
  }
  if (durable) file.sync();
  file.close();
  return written;
}

}  // namespace hyper_parallel::checkpoint::detail
