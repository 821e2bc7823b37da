#include "workspace_registry.h"

#include <map>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace fusedar::xla {
namespace {

// Handlers for several devices run concurrently on XLA's threads: readers share.
std::shared_mutex mu;
std::map<std::pair<int64_t, int32_t>, fusedar_rank*>& table() {
  static auto* t = new std::map<std::pair<int64_t, int32_t>, fusedar_rank*>();
  return *t;
}

}  // namespace

void register_rank(int64_t workspace_id, int32_t device_ordinal, fusedar_rank* rank) {
  std::unique_lock lock(mu);
  table()[{workspace_id, device_ordinal}] = rank;
}

void unregister_rank(const fusedar_rank* rank) {
  std::unique_lock lock(mu);
  for (auto it = table().begin(); it != table().end();) {
    it = it->second == rank ? table().erase(it) : std::next(it);
  }
}

fusedar_rank* find_rank(int64_t workspace_id, int32_t device_ordinal, std::string* why) {
  std::shared_lock lock(mu);
  auto it = table().find({workspace_id, device_ordinal});
  if (it != table().end()) return it->second;
  bool known = false;
  for (const auto& [key, rank] : table()) known |= key.first == workspace_id;
  *why = known ? "workspace " + std::to_string(workspace_id) + " has no rank on device " +
                     std::to_string(device_ordinal) +
                     " (the op runs on a device outside the mesh the workspace was made for)"
               : "no workspace with id " + std::to_string(workspace_id) +
                     " exists in this process. The id is the hash of the workspace's key "
                     "(backend, the mesh axis's members, max_token_num, hidden_dim, dtype, "
                     "name): create the workspace the program was built or exported for "
                     "with jax_fusedar.create_allreduce_fusion_workspace and the same "
                     "arguments before running it (or it was destroyed)";
  return nullptr;
}

}  // namespace fusedar::xla
