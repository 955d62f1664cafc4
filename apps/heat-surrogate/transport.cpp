#include "transport.hpp"

#include <string>

#include "fullshard/base/error.hpp"

namespace fullshard::apps::heat {
namespace {

constexpr int kTag = 7;  // one tag: messages between two ranks arrive in order

void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS)
    throw CommError(std::string("heat-surrogate transport: ") + what + " failed");
}

}  // namespace

Roles::Roles(MPI_Comm world, int train_ranks, double timeout_s) : timeout_s_(timeout_s) {
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  xfer_ = apps::BoundedComm::dup(world, "heat.world", timeout_s);
  transfer_ = std::make_unique<apps::BoundedComm>(xfer_, "heat.transfer", timeout_s);
  if (train_ranks == 0) {
    split_ = false;
    sims_ = trainers_ = size;
    sim_ = apps::BoundedComm::dup(world, "heat.world", timeout_s);
    train_ = apps::BoundedComm::dup(world, "heat.world", timeout_s);
    return;
  }
  if (train_ranks >= size)
    throw InvalidArgument("--train-ranks " + std::to_string(train_ranks) +
                          " leaves no simulation rank among " + std::to_string(size));
  split_ = true;
  trainers_ = train_ranks;
  sims_ = size - train_ranks;
  trains_ = rank < train_ranks;
  simulates_ = !trains_;
  sub_ = apps::BoundedComm::split(world, trains_ ? 0 : 1, rank, "heat.world", timeout_s);
  (trains_ ? train_ : sim_) = sub_;
}

Roles::~Roles() {
  transfer_.reset();
  for (MPI_Comm* c : {&xfer_, &sim_, &train_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

SampleSender::~SampleSender() {
  // Normal runs call finish(); after an error, do not leave requests behind.
  for (auto& round : rounds_)
    for (auto& p : round)
      if (p.request != MPI_REQUEST_NULL) MPI_Request_free(&p.request);
}

void SampleSender::send(const RoundRecords& records) {
  while (static_cast<int>(rounds_.size()) >= kMaxRoundsAhead) {
    for (auto& p : rounds_.front())
      roles_.transfer().wait(p.request, "sample send (rounds ahead)");
    rounds_.pop_front();
  }
  const int trainers = roles_.train_ranks();
  const int nt = records.train_count(stride_), ne = records.eval_count(stride_);
  std::vector<Pending> sends(trainers);
  for (int t = 0; t < trainers; ++t) {
    // Chunk t: records [n t / T, n (t + 1) / T) of each kind, after a two-float header
    // (counts are below 2^24, exact in f32).
    const int t0 = nt * t / trainers, t1 = nt * (t + 1) / trainers;
    const int e0 = ne * t / trainers, e1 = ne * (t + 1) / trainers;
    auto& msg = sends[t].message;
    msg.reserve(2 + static_cast<std::size_t>(t1 - t0 + e1 - e0) * stride_);
    msg.push_back(static_cast<float>(t1 - t0));
    msg.push_back(static_cast<float>(e1 - e0));
    msg.insert(msg.end(), records.train.begin() + static_cast<std::ptrdiff_t>(t0) * stride_,
               records.train.begin() + static_cast<std::ptrdiff_t>(t1) * stride_);
    msg.insert(msg.end(), records.eval.begin() + static_cast<std::ptrdiff_t>(e0) * stride_,
               records.eval.begin() + static_cast<std::ptrdiff_t>(e1) * stride_);
    // Synchronous mode: a send completes only once its trainer has started receiving it, so
    // the rounds-ahead limit bounds memory on both sides (a buffered eager send would not).
    check_mpi(MPI_Issend(msg.data(), static_cast<int>(msg.size()), MPI_FLOAT,
                         roles_.world_rank_of_trainer(t), kTag, roles_.transfer_comm(),
                         &sends[t].request),
              "MPI_Issend (samples)");
  }
  rounds_.push_back(std::move(sends));
}

void SampleSender::finish() {
  for (auto& round : rounds_)
    for (auto& p : round)
      roles_.transfer().wait(p.request, "sample send (finish)");
  rounds_.clear();
}

RoundRecords receive_round(const Roles& roles, int stride) {
  RoundRecords out;
  std::vector<float> msg;
  for (int s = 0; s < roles.sim_ranks(); ++s) {
    const int source = roles.world_rank_of_sim(s);
    const MPI_Status status = roles.transfer().probe(source, kTag, "sample receive (probe)");
    int count = 0;
    MPI_Get_count(&status, MPI_FLOAT, &count);
    msg.resize(static_cast<std::size_t>(count));
    roles.transfer().recv(msg.data(), count, MPI_FLOAT, source, kTag, "sample receive");
    const auto nt = static_cast<std::size_t>(msg.at(0)), ne = static_cast<std::size_t>(msg.at(1));
    if (static_cast<std::size_t>(count) != 2 + (nt + ne) * static_cast<std::size_t>(stride))
      throw CommError("heat-surrogate transport: malformed sample message from world rank " +
                      std::to_string(source));
    const auto train_end = msg.begin() + 2 + static_cast<std::ptrdiff_t>(nt * stride);
    out.train.insert(out.train.end(), msg.begin() + 2, train_end);
    out.eval.insert(out.eval.end(), train_end, msg.end());
  }
  return out;
}

}  // namespace fullshard::apps::heat
