#!/usr/bin/env python3
"""Checks fullshard's layering (docs/architecture.md) on the #include lines of the tree.

The layer order is read from the table in docs/architecture.md (first column, top row =
lowest layer), so the document and the check cannot drift apart. A file of layer L is one
under include/fullshard/L/ or lib/L/. It fails on:

  - upward:  a file of layer L includes fullshard/M/... of a layer M above L;
  - private: a file includes lib/M/... (a private header: every header under lib/, the
             layers' internals) and is not itself in lib/M/ (public headers and apps/ may
             never include lib/ headers; lib/base/ is the toolkit of every layer), unless
             ALLOWED lists the use with its reason;
  - detail:  an installed header (include/fullshard/...) under a detail/ folder: a layer's
             internals live in lib/<layer>/, where this check sees who uses them;
  - unknown: a file or header of a layer that the table does not list;
  - stale:   an ALLOWED entry below that no longer occurs (the list only shrinks).

Usage: check_layers.py [ROOT]          check the tree at ROOT (default: two levels up)
       check_layers.py --self-test     plant violations in a scratch tree and check that
                                       each is reported (and a clean tree passes)
"""
import os
import re
import shutil
import sys
import tempfile

# Known uses of another layer's private header, (using layer, included header): reason. Each
# is a layer's internal interface that other layers of the library need and no user does, so
# it is not made public (installed). Add an entry only with a reason; an entry that no longer
# occurs fails. The private headers of the lowest layer, base (lib/base/: hashing, the strict
# JSON reader, waiting on MPI requests), are the library's own toolkit: every layer may use
# them (BASE_TOOLKIT), apps/ may not.
_GROUP_ACCESS = (
    "a group's parameters and shard storage (fsdp::detail::sharded_storage, "
    "adopt_sharded_storage, ...): the layers that step, save or view a group's shards in place "
    "use them; users go through FSDPModule"
)
_GROUP_RULES = (
    "one implementation of fully_shard's grouping rules, which the planner applies to the "
    "graph it plans"
)
_AGREEMENT = (
    "the cross-rank agreement check (every rank compares what it declared before the first "
    "collective, naming the first difference): fully_shard's groups, the C API's and the "
    "session's configurations use it"
)
_STAGING = (
    "device tensors staged through page-locked host memory: the layers that copy a group's "
    "shards or an optimizer's state between device and host (state dicts, checkpoints, loads, "
    "CPU offload) use it"
)
_FINITE_SCAN = (
    "one finiteness scan of host arrays: the optimizer's check of gradient shards and the "
    "session's check of a step's inputs"
)
_SHM_COMM = (
    "a node's shared memory among a dim's ranks (comm::ShmComm, its windows and flags): the mesh "
    "makes one per dim, the shared-memory transport runs its collectives on it, the plan counts "
    "its windows; users reach it only through the mesh"
)
_MULTI_SOURCE = (
    "the reduce kernels of the shared-memory collectives: the transport runs them, the cost "
    "model times them"
)
ALLOWED = {
    ("checkpoint", "lib/fsdp/group_access.hpp"): _GROUP_ACCESS,
    ("optim", "lib/fsdp/group_access.hpp"): _GROUP_ACCESS,
    ("torch", "lib/fsdp/group_access.hpp"): _GROUP_ACCESS,
    ("schedule", "lib/fsdp/group_rules.hpp"): _GROUP_RULES,
    ("schedule", "lib/fsdp/state_machine.hpp"): (
        "the FSDP engine exists once: the planner runs the engine's state machine on a "
        "planning backend (docs/architecture.md)"
    ),
    ("schedule", "lib/transport/charges.hpp"): (
        "what each transport operation costs, derived from the transports' fusions: the "
        "planner prices its plan with it"
    ),
    ("fsdp", "lib/transport/group_transport.hpp"): (
        "a parameter group owns its communication group's transport (the interface the "
        "transports implement), and the running backend issues the group's collectives on it"
    ),
    ("fsdp", "lib/transport/device.hpp"): (
        "the running backend orders the operations on the root's device (host, or CUDA "
        "streams and the stream-ordered pool)"
    ),
    ("fsdp", "lib/mesh/agreement.hpp"): _AGREEMENT,
    ("capi", "lib/mesh/agreement.hpp"): _AGREEMENT,
    ("session", "lib/mesh/agreement.hpp"): _AGREEMENT,
    ("fsdp", "lib/tensor/staging.hpp"): _STAGING,
    ("transport", "lib/tensor/staging.hpp"): _STAGING,
    ("optim", "lib/tensor/staging.hpp"): _STAGING,
    ("checkpoint", "lib/tensor/staging.hpp"): _STAGING,
    ("schedule", "lib/graph/json_forms.hpp"): (
        "the auto-planner writes the requests it chose in the graph file's form"
    ),
    ("schedule", "lib/tensor/shard_extent.hpp"): (
        "the planner's sizes of a shard without building its layout (its hot path)"
    ),
    ("transport", "lib/tensor/stream_pool.hpp"): (
        "the CUDA device's buffers come from the stream-ordered caching pool"
    ),
    ("mesh", "lib/comm/nccl_communicator.hpp"): (
        "the mesh creates its NCCL communicators; users reach them as Communicator"
    ),
    ("optim", "lib/fsdp/shard_update.hpp"): (
        "an optimizer inside backward is an update the engine runs at each group's reduction "
        "(optim::Optimizer::run_in_backward is the user API)"
    ),
    ("optim", "lib/kernels/finite_scan.hpp"): _FINITE_SCAN,
    ("session", "lib/kernels/finite_scan.hpp"): _FINITE_SCAN,
    ("transport", "lib/kernels/multi_source.hpp"): _MULTI_SOURCE,
    ("mesh", "lib/comm/shm.hpp"): _SHM_COMM,
    ("transport", "lib/comm/shm.hpp"): _SHM_COMM,
    ("schedule", "lib/comm/shm.hpp"): _SHM_COMM,
    ("schedule", "lib/fsdp/engine.hpp"): (
        "the FSDP engine exists once: the planner builds the engine's groups and implements its "
        "Backend interface (a plan's operations are the engine's, fullshard/fsdp/operations.hpp)"
    ),
    ("schedule", "lib/kernels/multi_source.hpp"): _MULTI_SOURCE,
    ("session", "lib/checkpoint/index_json.hpp"): (
        "a program's checkpoint metadata (set_checkpoint_metadata) is read the one way "
        "checkpoint::save reads it (parse_metadata)"
    ),
    ("session", "lib/checkpoint/torchscript_archive.hpp"): (
        "a TorchScript model file named in a session's configuration is checked before "
        "LibTorch reads it"
    ),
    ("torch", "lib/fsdp/front_end.hpp"): (
        "the LibTorch front end's autograd supplies the gradients (what a front end needs of "
        "fully_shard beyond the native API)"
    ),
}
BASE_TOOLKIT = "base"

# Headers at include/fullshard/ itself: the generated config (usable by every layer) and the
# umbrella header (above every layer: for applications only).
CONFIG = "fullshard/config.hpp"
UMBRELLA = "fullshard/fullshard.hpp"
# Public headers at include/fullshard/ itself that belong to a layer: the C API's header.
TOP_LAYER_HEADERS = {"fullshard/fullshard.h": "capi"}

SOURCE_EXT = (".hpp", ".h", ".cpp", ".cc", ".cu", ".cuh", ".inl")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]')


def read_layers(root):
    """Layer names in order (lowest first) from docs/architecture.md's layer table."""
    path = os.path.join(root, "docs", "architecture.md")
    layers, in_table = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|") and cells[:2] == ["layer", "owns"]:
                in_table = True
                continue
            if in_table:
                if not line.startswith("|"):
                    break
                m = re.fullmatch(r"`([a-z_]+)`", cells[0])
                if m:
                    layers.append(m.group(1))
                elif not re.fullmatch(r"-+", cells[0]):
                    raise SystemExit(f"{path}: cannot read the layer table row: {line.strip()}")
    if not layers:
        raise SystemExit(f"{path}: no layer table ('| layer | owns |') found")
    return layers


def layer_of(rel):
    """("layer", name) for include/fullshard/<L>/ and lib/<L>/ files, ("apps", None) for
    apps/, ("top", None) for include/fullshard/*.hpp, None otherwise."""
    parts = rel.split("/")
    if parts[0] == "lib" and len(parts) > 2:
        return ("layer", parts[1])
    if parts[:2] == ["include", "fullshard"]:
        return ("layer", parts[2]) if len(parts) > 3 else ("top", None)
    if parts[0] == "apps":
        return ("apps", None)
    return None


def files(root):
    for top in ("include", "lib", "apps"):
        for d, _, names in os.walk(os.path.join(root, top)):
            for n in sorted(names):
                if n.endswith(SOURCE_EXT):
                    yield os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")


def check(root, allowed):
    """(violations, stale allow-list entries), each sorted."""
    layers = read_layers(root)
    rank = {name: i for i, name in enumerate(layers)}
    found, used = [], set()

    def report(rel, line_no, header, why, key=None):
        if key is not None and key in allowed:
            used.add(key)
        else:
            found.append(f"{rel}:{line_no}: includes {header}: {why}")

    for rel in files(root):
        kind, mine = layer_of(rel) or (None, None)
        if rel.startswith("include/") and "/detail/" in rel:
            found.append(f"{rel}: an installed header in a detail/ folder (move it to lib/)")
        if kind == "layer" and mine not in rank:
            found.append(f"{rel}: layer '{mine}' is not in docs/architecture.md's layer table")
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                m = INCLUDE_RE.match(line)
                if not m:
                    continue
                header = m.group(1)
                hp = header.split("/")
                if hp[0] == "lib" and len(hp) > 2:  # a private header of layer hp[1]
                    if kind == "apps":
                        report(
                            rel,
                            line_no,
                            header,
                            "apps/ may use only public headers " "(include/fullshard/...)",
                        )
                    elif kind == "top" or (kind == "layer" and rel.startswith("include/")):
                        report(rel, line_no, header, "a public header includes a private one")
                    elif kind == "layer" and hp[1] != mine and hp[1] != BASE_TOOLKIT:
                        report(
                            rel,
                            line_no,
                            header,
                            f"a private header of layer '{hp[1]}' " f"used from layer '{mine}'",
                            key=(mine, header),
                        )
                elif hp[0] == "fullshard" and kind == "layer":
                    if header == CONFIG:
                        continue
                    if header in TOP_LAYER_HEADERS:
                        hp = ["fullshard", TOP_LAYER_HEADERS[header], hp[-1]]
                    if header == UMBRELLA or len(hp) < 3:
                        report(rel, line_no, header, "the umbrella header is for applications")
                    elif hp[1] not in rank:
                        report(
                            rel,
                            line_no,
                            header,
                            f"layer '{hp[1]}' is not in " "docs/architecture.md's layer table",
                        )
                    elif rank[hp[1]] > rank[mine]:
                        report(
                            rel,
                            line_no,
                            header,
                            f"layer '{mine}' uses layer '{hp[1]}' "
                            f"above it (order: {' < '.join(layers)})",
                        )
    stale = sorted(f"layer {f}: includes {h}" for f, h in set(allowed) - used)
    return sorted(found), stale


def main(root):
    found, stale = check(root, ALLOWED)
    layers = read_layers(root)
    print(f"layers (docs/architecture.md): {' < '.join(layers)}")
    print(f"known uses of another layer's private header ({len(ALLOWED) - len(stale)}):")
    for (f, h), why in sorted(ALLOWED.items()):
        print(f"  layer {f}: includes {h}: {why}")
    for v in found:
        print(f"LAYER VIOLATION {v}")
    for s in stale:
        print(f"STALE ALLOW-LIST ENTRY (fixed: delete it from test/layers/check_layers.py) {s}")
    if found or stale:
        print(f"layer check FAILED: {len(found)} violation(s), {len(stale)} stale entr(y/ies)")
        return 1
    print("layer check passed")
    return 0


def self_test(real_root):
    """Plants each kind of violation in a scratch tree (with the real architecture.md)."""
    tmp = tempfile.mkdtemp(prefix="fullshard-layers-")
    try:

        def write(rel, text):
            p = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)

        os.makedirs(os.path.join(tmp, "docs"))
        shutil.copy(os.path.join(real_root, "docs", "architecture.md"), os.path.join(tmp, "docs"))
        # A clean tree: downward and same-layer includes only.
        write("include/fullshard/comm/stream.hpp", '#include "fullshard/base/error.hpp"\n')
        write(
            "lib/comm/stream.cpp",
            '#include "fullshard/comm/stream.hpp"\n'
            '#include "lib/comm/private.hpp"\n#include "fullshard/config.hpp"\n',
        )
        write("lib/comm/private.hpp", "#include <mpi.h>\n")
        write("apps/a/main.cpp", '#include "fullshard/fullshard.hpp"\n#include "local.hpp"\n')
        ok, stale = check(tmp, set())
        assert ok == [] and stale == [], (ok, stale)
        # Planted: one of each kind, plus a stale allow-list entry.
        write("lib/base/up.cpp", '#include "fullshard/comm/stream.hpp"\n')
        write("lib/mesh/peek.cpp", '#include "lib/comm/private.hpp"\n')
        write("apps/a/bad.cpp", '#include "lib/comm/private.hpp"\n')
        write("include/fullshard/tensor/t.hpp", '#include "lib/tensor/x.hpp"\n')
        write("lib/nowhere/x.cpp", "\n")
        write("include/fullshard/fsdp/detail/inner.hpp", "\n")
        # Not violations: a listed use, and the base layer's toolkit from any layer.
        write("lib/kernels/listed.cpp", '#include "lib/comm/private.hpp"\n')
        write("lib/base/tool.hpp", "\n")
        write("lib/mesh/tool_user.cpp", '#include "lib/base/tool.hpp"\n')
        allowed = {("kernels", "lib/comm/private.hpp"), ("gone", "lib/x/y.hpp")}
        found, stale = check(tmp, allowed)
        expect = [
            "apps/a/bad.cpp:1: includes lib/comm/private.hpp",
            "include/fullshard/fsdp/detail/inner.hpp: an installed header in a detail/ folder",
            "include/fullshard/tensor/t.hpp:1: includes lib/tensor/x.hpp",
            "lib/base/up.cpp:1: includes fullshard/comm/stream.hpp",
            "lib/mesh/peek.cpp:1: includes lib/comm/private.hpp",
            "lib/nowhere/x.cpp: layer 'nowhere'",
        ]
        assert len(found) == len(expect) and all(
            f.startswith(e) for f, e in zip(found, expect)
        ), found
        assert stale == ["layer gone: includes lib/x/y.hpp"], stale
        found, _ = check(tmp, set())
        assert any(
            f.startswith(
                "lib/base/up.cpp:1: includes fullshard/comm/stream.hpp: layer "
                "'base' uses layer 'comm' above it"
            )
            for f in found
        ), found
        print("layer check self-test passed: every planted violation was reported")
        return 0
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    default_root = os.path.dirname(os.path.dirname(here))
    if sys.argv[1:2] == ["--self-test"]:
        sys.exit(self_test(sys.argv[2] if len(sys.argv) > 2 else default_root))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else default_root))
