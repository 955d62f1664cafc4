// The split of the world into simulation and training ranks, and the samples' way from one
// to the other.
//
// --train-ranks 0: every rank simulates (its rows) and trains (on its own samples), in turn.
// --train-ranks T: world ranks 0..T-1 train, ranks T.. simulate (MPI_Comm_split). Each
// round every simulation rank splits its records into T equal chunks and sends chunk t to
// trainer t (nonblocking, on a duplicate of the world communicator), so every trainer gets
// a slice of the whole grid. A simulation rank runs at most kMaxRoundsAhead rounds ahead of
// the trainers (it waits for older sends), which bounds the memory in flight. Every wait is
// bounded by FULLSHARD_TIMEOUT (apps::BoundedComm): a stopped or missing rank aborts the job
// with the library's timeout message instead of hanging it.
#pragma once

#include <mpi.h>

#include <deque>
#include <memory>
#include <vector>

#include "bounded_comm.hpp"

namespace fullshard::apps::heat {

class Roles {
 public:
  /// Collective over `world`. `train_ranks` 0: time-sliced, else 1 <= T < world size.
  /// `timeout_s` bounds every wait of the sample transfer (FULLSHARD_TIMEOUT).
  Roles(MPI_Comm world, int train_ranks, double timeout_s);
  ~Roles();
  Roles(const Roles&) = delete;
  Roles& operator=(const Roles&) = delete;

  bool split() const noexcept { return split_; }
  bool simulates() const noexcept { return simulates_; }
  bool trains() const noexcept { return trains_; }
  int sim_ranks() const noexcept { return sims_; }
  int train_ranks() const noexcept { return trainers_; }
  /// The simulation ranks' communicator (valid where simulates()).
  MPI_Comm sim_comm() const noexcept { return sim_; }
  /// The training ranks' communicator (valid where trains()).
  MPI_Comm train_comm() const noexcept { return train_; }
  /// World rank of simulation rank s / training rank t.
  int world_rank_of_sim(int s) const noexcept { return split_ ? trainers_ + s : s; }
  int world_rank_of_trainer(int t) const noexcept { return t; }
  /// Duplicate of the world communicator for the sample messages.
  MPI_Comm transfer_comm() const noexcept { return xfer_; }
  /// transfer_comm() with bounded waits ('heat.transfer').
  apps::BoundedComm& transfer() const noexcept { return *transfer_; }
  double timeout_s() const noexcept { return timeout_s_; }

 private:
  bool split_ = false, simulates_ = true, trains_ = true;
  int sims_ = 1, trainers_ = 1;
  MPI_Comm sim_ = MPI_COMM_NULL, train_ = MPI_COMM_NULL, xfer_ = MPI_COMM_NULL;
  MPI_Comm sub_ = MPI_COMM_NULL;  // the split's communicator (sim_ or train_)
  double timeout_s_ = 0;
  std::unique_ptr<apps::BoundedComm> transfer_;
};

/// One round's records of one or more simulation ranks (`stride` floats each).
struct RoundRecords {
  std::vector<float> train;
  std::vector<float> eval;
  int train_count(int stride) const { return static_cast<int>(train.size()) / stride; }
  int eval_count(int stride) const { return static_cast<int>(eval.size()) / stride; }
};

constexpr int kMaxRoundsAhead = 4;

/// On a simulation rank (split mode).
class SampleSender {
 public:
  SampleSender(const Roles& roles, int stride) : roles_(roles), stride_(stride) {}
  ~SampleSender();
  /// Sends the round's records, chunk t to trainer t. Waits for sends older than
  /// kMaxRoundsAhead rounds first.
  void send(const RoundRecords& records);
  /// Waits for every send.
  void finish();

 private:
  struct Pending {
    std::vector<float> message;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  const Roles& roles_;
  int stride_;
  std::deque<std::vector<Pending>> rounds_;  // oldest first
};

/// On a training rank (split mode): the round's chunks of every simulation rank, in
/// simulation-rank order. Waits with the bounded wait's back-off (it sleeps once a wait lasts,
/// leaving the core to the ranks that work).
RoundRecords receive_round(const Roles& roles, int stride);

}  // namespace fullshard::apps::heat
