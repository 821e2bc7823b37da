// Bounded waits: the memory layout shared by the host core and the kernel translation units.
//
// Every wait loop the kernels run (FlashInfer's Lamport polls, two-shot barrier flags and
// grid counters, in the dense kernels and the MoE ones (patterns 6, 7), patched in by
// ffi/cmake/FlashInferHeaders.cmake; the call check's handshake; the large-message
// algorithm's entry and chunk flags, large_sync.cuh) reads the device clock every so many
// iterations. Past the workspace's timeout
// the first waiting thread records what it waited for in pinned host memory (`Record`) and
// traps: the stream fails with a CUDA error, and fusedar_launch refuses every later call
// on that workspace with the recorded text (read from host memory, which survives the dead
// context).
//
// How the kernel finds the timeout and the record without changing FlashInfer's params:
// through the control block, workspace[3N], which every kernel already reads. FlashInfer
// uses its first five ints; our fields follow (`Control`). The kernel reads them only on
// the slow path (after kCheckEvery spins), so the hot path costs one counter increment and
// a rarely taken branch per spin.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fusedar::watchdog {

// What failed (Record::kind). 1-3 are the call check's handshake (call_check.h).
enum Kind : int { kNone = 0, kMismatch = 1, kTimeout = 2, kOutOfStep = 3, kWaitTimeout = 4 };

// Which wait of the fused kernel timed out (Record::site).
enum Site : int {
  kHandshake = 0,  // the call check's handshake kernel
  kLamport = 1,    // one-shot (dense and MoE): a peer's data in this rank's Lamport buffer
  kBarrier = 2,    // two-shot: a peer's barrier flag
  kGrid = 3,       // this rank's own thread blocks (grid counter at the end of the kernel)
  // The large-message algorithm (ffi/kernels/large_message.h):
  kLargeEnter = 4,    // a peer's entry flag (it has entered the same large-message call)
  kLargeScatter = 5,  // a peer's scatter flag: its input rows of one chunk of our slice
  kLargeGather = 6,   // a peer's gather flag: one reduced chunk of its slice
};

constexpr uint64_t kDefaultTimeoutNs = 30ull * 1000000000ull;
// Spins between two reads of %globaltimer (each spin is at least one L2 round trip, so
// this is well under a millisecond of spinning).
constexpr unsigned kCheckEvery = 1024;

// Written once per workspace by the failing thread (fields first, then `kind`), read by
// the host. Lives in pinned, device-mapped host memory.
struct Record {
  int kind;
  int rank;
  int world;
  int device;
  int peer;           // the rank whose data/flag/handshake did not arrive (-1: none / own grid)
  int failing_peers;  // handshake: how many ranks failed the check
  int site;           // Site
  int detail;         // kLamport: token index; kBarrier: thread block; kGrid: grid size;
               // kLargeEnter: large-message call number; kLargeScatter/Gather: chunk
  unsigned long long seq;  // this rank's call number (1 = first call on the workspace)
  unsigned long long peer_seq;  // handshake: the latest call number seen from `peer`
  unsigned long long mine[3];  // signature of this rank's call (call_check::Signature)
  unsigned long long theirs[3];  // handshake kMismatch: the peer's signature
  unsigned long long waited_ns;
  unsigned long long timeout_ns;
};

// What a wait knows about its call, as call_check::signature_of encodes it:
// {word, num_tokens, hidden_dim}. Written into the record (Record::mine).
struct CallInfo {
  unsigned long long sig[3];
};

// The control block, workspace[3N]: FlashInfer's five ints (counter, two-shot flag,
// Lamport flag, Lamport comm size, Lamport clear size), then ours. Local to the rank.
struct Control {
  int flashinfer[5];
  int claimed;  // 0 until a waiting thread claims the record (atomicCAS)
  unsigned long long timeout_ns;  // 0: wait forever (FlashInfer's behaviour)
  unsigned long long calls;  // fused calls started on this rank: FlashInfer's kernels
                             // (block 0 counts) and large-message calls (the enter kernel)
  Record* record;  // device address of the pinned record
  int rank;
  int world;
  int device;
  int reserved;
};
static_assert(sizeof(Control) == 64, "Control layout");
static_assert(offsetof(Control, claimed) == 20, "FlashInfer's ints come first");

}  // namespace fusedar::watchdog
