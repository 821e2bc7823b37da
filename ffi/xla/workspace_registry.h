// Maps (workspace id, XLA device ordinal) to the native rank state.
//
// A jitted program is SPMD: every device runs the same custom call with the same
// attributes, so the attribute can only name a workspace *set* (one per
// create_allreduce_fusion_workspace call, covering every TP group of the mesh), by the
// hash of its stable key (jax_fusedar/workspace.py), so exported programs find it; the
// device ordinal XLA hands each handler (Ctx<DeviceOrdinal>, never cudaGetDevice)
// then picks that device's rank within its own group.
#pragma once

#include <cstdint>
#include <string>

#include "fusedar/core.h"

namespace fusedar::xla {

void register_rank(int64_t workspace_id, int32_t device_ordinal, fusedar_rank* rank);
// Removes one rank wherever it is registered (called before the rank is destroyed).
void unregister_rank(const fusedar_rank* rank);
// Returns the rank or nullptr, with *why explaining the miss.
fusedar_rank* find_rank(int64_t workspace_id, int32_t device_ordinal, std::string* why);

}  // namespace fusedar::xla
