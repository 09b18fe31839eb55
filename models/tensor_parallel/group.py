"""A tensor-parallel group's processes. Rank 0 is the engine's own process: it schedules, samples and streams,
and before each forward sends the batch through the group's segment. Each follower is a spawned process pinned
to its share of the cores, with its shard of the weights and its own KV cache (its KV heads, the same blocks);
it runs every forward rank 0 sends it and returns nothing but its part of the collectives."""

import multiprocessing
import queue
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numba

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import AdapterError, CheckpointError, InvalidRequest, RankLost
from kernels import resolve_num_threads
from memory.kv_cache import KVCache
from memory.numa import bind_memory, physical_node_ids, pin_process, read_topology
from memory.shared_group import GroupLayout, SharedGroup
from models.decoder import DecoderModel
from models.lora.merge import MergedRows, MergedWeights, merge_adapter
from models.lora.slots import LoraRows, LoraSlots, slot_dtype
from models.model_spec import ModelSpec
from models.tensor_parallel.collectives import Sharded
from models.tensor_parallel.orders import MergedOrder, StopOrder
from models.tensor_parallel.shard import TensorShard
from models.tensor_parallel.wire import decode, encode

START_TIMEOUT_S = 600.0  # a follower loads and packs its shard (numba may compile first) before this
STOP_TIMEOUT_S = 10.0
PLAN_BYTES = 4 << 20


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower needs to build its part of the engine (pickled to its process)."""
    model_path: str
    config: EngineConfig
    layout: GroupLayout
    rank: int
    cpu_ids: tuple[int, ...]
    num_blocks: int
    max_model_len: int
    num_shadows: int


@dataclass(frozen=True)
class RankReady:
    """A follower to rank 0 once its shard is loaded: what it holds."""
    rank: int
    weight_bytes: int
    kv_cache_bytes: int


def rank_shard(rank: int, config: EngineConfig) -> TensorShard:
    """What rank `rank` of the engine's group holds."""
    return TensorShard(rank, config.tensor_parallel_size, config.enable_expert_parallel)


def core_shares(cpu_ids: list[int], size: int) -> list[tuple[int, ...]]:
    """The allowed cores split evenly between the ranks (rank r gets the r-th share, never an empty one)."""
    if len(cpu_ids) < size:
        raise ValueError(f"tensor_parallel_size {size} needs a core a rank; this process may use "
                         f"{len(cpu_ids)}: lower tensor_parallel_size")
    per = len(cpu_ids) // size
    return [tuple(cpu_ids[r * per:(r + 1) * per]) for r in range(size)]


def slot_elems(config: EngineConfig, hidden: int, vocab: int, size: int) -> int:
    """The largest collective a step moves: the residual stream [T, hidden], or logits [T, vocab / size]."""
    return config.max_num_batched_tokens * max(hidden, -(-vocab // size))


def follower_main(spec: FollowerSpec, status, adapters) -> None:
    """A follower's process: pin, load the shard, report, then run rank 0's forwards until told to stop.
    adapters: the receiving end of its adapter pipe (the LoRA adapters rank 0 loads into slots)."""
    from models.packed.planned_load import load_planned

    if spec.cpu_ids:
        pin_process(spec.cpu_ids)
        bind_memory(physical_node_ids(spec.cpu_ids, read_topology()))  # its shard and KV on its node
    numba.set_num_threads(resolve_num_threads(spec.config.num_threads, spec.cpu_ids))
    shard = rank_shard(spec.rank, spec.config)
    group = SharedGroup.attach(spec.layout, spec.rank)
    try:
        loaded = load_planned(spec.model_path, spec.config, DecisionLog(), shard)
        local = shard.local_spec(loaded.spec)
        collectives = Sharded(group, shard, loaded.spec.vocab_size, numba.get_num_threads())
        model = DecoderModel(local, loaded.weights, spec.max_model_len, collectives)
        c = spec.config
        kv = KVCache(local.num_layers, spec.num_blocks, c.block_size, local.num_kv_heads, local.head_dim,
                     c.resolved_kv_dtype, c.kv_dtype_overrides, num_shadows=spec.num_shadows)
        slots = LoraSlots(loaded.spec, c.max_loras, c.max_lora_rank, slot_dtype(model.weight_dtype, local),
                          shard)  # rank 0's slot for slot, its part of each adapter
        merged: dict[str, MergedWeights] = {}  # its parts of the merged copies rank 0 holds
    except Exception as e:  # noqa: BLE001 - rank 0 raises it
        status.put(RankFailed(spec.rank, type(e).__name__, str(e)))
        group.abort()
        group.close()
        return
    status.put(RankReady(spec.rank, model.weight_bytes, kv.nbytes))
    try:
        while True:
            order = decode(group.receive_plan())
            if isinstance(order, StopOrder):
                break
            batch, lora = order.batch, order.lora
            if lora is not None:
                for slot in lora.loads:
                    slots.load(decode(adapters.recv_bytes()), slot)
                batch = replace(batch, lora=LoraRows(lora.starts, lora.ends, lora.slots, slots))
            if order.merged is not None:
                batch = replace(batch, merged=_merged_rows(order.merged, merged, adapters,
                                                           model.weights.layers, shard, loaded.spec))
            model.forward_hidden(batch, kv, order.embeddings)
    except (RankLost, EOFError, OSError):
        pass  # rank 0 is gone or gave up (its pipe closed): nothing is left to serve
    finally:
        group.close()


def _merged_rows(order: MergedOrder, held: dict[str, MergedWeights], adapters, base_layers,
                 shard: TensorShard, spec: ModelSpec) -> MergedRows:
    """A forward's merged rows on this follower: the copies rank 0 made for it merged here too (their adapters
    read from the pipe, in order), the ones rank 0 dropped dropped (held: name -> copy, updated)."""
    for name in order.built:
        adapter = decode(adapters.recv_bytes())
        held[name] = merge_adapter(base_layers, adapter.rank_part(shard, spec), shard.local_spec(spec))
    for name in [n for n in held if n not in order.held]:
        del held[name]
    return MergedRows(tuple((a, b, held[name]) for a, b, name in order.runs))


@dataclass(frozen=True)
class RankFailed:
    """A follower to rank 0 when its start failed: the error's class name and message."""
    rank: int
    kind: str
    message: str

    def error(self) -> Exception:
        """The error as rank 0 raises it: numaserve's typed errors (and ValueError, a bad config) as they were
        raised, anything else a RankLost naming it."""
        kinds = {cls.__name__: cls for cls in (CheckpointError, AdapterError, InvalidRequest, ValueError)}
        if self.kind in kinds:
            e = kinds[self.kind](self.message)
            e.add_note(f"(raised on tensor-parallel rank {self.rank})")
            return e
        return RankLost(f"tensor-parallel rank {self.rank} could not start: {self.kind}: {self.message}")


class RankGroup:
    """Rank 0's handle on its followers."""

    def __init__(self, group: SharedGroup, procs: list, status):
        """procs: the followers' processes; status: the queue each puts its RankReady or start error on."""
        self.group, self.procs, self._status = group, procs, status
        self.adapter_pipes: list = []  # the sending end of each follower's adapter pipe, in rank order
        self.ready: list[RankReady] = []  # the followers', in rank order, once wait_ready() returned
        self._closed = False

    @classmethod
    def start(cls, model_path: str | Path, config: EngineConfig, shares: list[tuple[int, ...]], *,
              hidden: int, vocab: int, num_blocks: int, max_model_len: int, num_shadows: int) -> "RankGroup":
        """Creates the segment, spawns the followers, rank r pinned to shares[r] (they load their shards while
        rank 0 loads its own: call wait_ready() after)."""
        size = config.tensor_parallel_size
        layout = GroupLayout.new(size, slot_elems(config, hidden, vocab, size), PLAN_BYTES)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked numba or Ray threads
        handle = cls(SharedGroup.create(layout), [], ctx.Queue())
        try:
            for rank in range(1, size):
                spec = FollowerSpec(str(model_path), config, layout, rank, shares[rank], num_blocks,
                                    max_model_len, num_shadows)
                receive, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=follower_main, args=(spec, handle._status, receive), daemon=True,
                                   name=f"numaserve-tp-rank-{rank}")
                proc.start()
                receive.close()  # the follower's end: a follower gone breaks the pipe for rank 0
                handle.procs.append(proc)
                handle.adapter_pipes.append(send)
        except BaseException:
            handle.close()
            raise
        return handle

    def wait_ready(self) -> None:
        """Waits until every follower has mapped the segment and loaded its shard; raises a follower's start
        error as it was raised, or RankLost (a follower died, or took over START_TIMEOUT_S); the followers are
        stopped then."""
        try:
            self.group.wait_attached(alive=lambda: all(p.is_alive() for p in self.procs))
            reports = self._reports()
        except BaseException:
            self.close()
            raise
        problems = [r for r in reports if isinstance(r, RankFailed)]
        if problems:
            self.close()
            raise problems[0].error()  # as rank 0 would have raised it (a bad config, a bad checkpoint)
        self.ready = sorted(reports, key=lambda r: r.rank)

    def _reports(self) -> list:
        """Every follower's report; a follower that ended without one is RankLost (checked each second)."""
        reports, deadline = [], time.monotonic() + START_TIMEOUT_S
        while len(reports) < len(self.procs):
            try:
                reports.append(self._status.get(timeout=1.0))
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs) and self._status.empty():
                    raise RankLost("a tensor-parallel rank's process ended while it loaded its shard "
                                   "(killed, or out of memory?); make the engine again") from None
                if time.monotonic() > deadline:
                    raise RankLost("a tensor-parallel rank did not load its shard within "
                                   f"{START_TIMEOUT_S:.0f} s") from None
        return reports

    def collectives(self, shard: TensorShard, vocab: int, num_threads: int) -> Sharded:
        return Sharded(self.group, shard, vocab, num_threads, leader=True,
                       adapter_pipes=tuple(self.adapter_pipes))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stops the followers (asked, then terminated after STOP_TIMEOUT_S). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                self.group.send_plan(encode(StopOrder()))
        except (RankLost, ValueError):
            pass
        for p in self.procs:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.terminate()
                p.join(STOP_TIMEOUT_S)
        for pipe in self.adapter_pipes:
            pipe.close()
        self.group.unlink()
        self.group.close()
