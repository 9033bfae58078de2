"""Where the trainer's batches come from: a ZeroMQ PULL socket, and padding into tensors.

The trainer knows only the wire contract (``prime_rl.wire``), never the orchestrator:
tests drive it with a PUSH socket and hand-made ``TrainBatch`` messages. Frames are
msgpack (``decode_batch``), never pickle; a frame that fails validation is logged and
skipped, so one bad message cannot crash a run or be trained on. A frame above
``transport.max_message_bytes`` never reaches Python: libzmq reads its length, drops the
connection before buffering it (``MAXMSGSIZE``) and reconnects; the socket monitor logs that.
With the launcher's keys the socket is a CURVE client: it talks only to the orchestrator
holding the run's server key, which admits only this client key (``orchestrator.sender``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from prime_rl.config import TransportConfig
from prime_rl.wire import (
    DEFAULT_MAX_FRAME_BYTES, MicroBatch, TrainBatch, WireError, decode_batch, sample_arrays, teacher_array, teacher_top_arrays,
)
from trainer.head import HeadQuery
from trainer.packing import (
    Layout, attention_allowed, lay_out, plan_blocks, plan_micro_batches, plan_rows, row_budget, varlen_boundaries,
)


# Socket events that mean libzmq dropped the connection to the orchestrator, or failed its
# CURVE handshake, and CONNECT_RETRIED, which says libzmq reconnects by itself (it does after
# a lost connection, not after a protocol error: a frame above MAXMSGSIZE, a refused key).
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | _HANDSHAKE_FAILED
RECONNECT_S = 1.0
"""Wait after a dropped connection before connecting again, unless libzmq does it first."""


def _log(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


class BatchReceiver:
    """PULL socket that connects to the orchestrator's PUSH at ``tcp://host:port + rank``."""

    def __init__(
        self, cfg: TransportConfig, rank: int, log: Callable[[str], None] = _log, vocab_size: int | None = None
    ):
        """``vocab_size``: rows of the model's embedding; batches with ids outside it are rejected."""
        if cfg.curve_client_secret is None and cfg.leaves_loopback():
            raise OSError(
                f"refusing to take batches from {cfg.host} without CURVE keys: anyone reaching that port could "
                "feed the trainer (the launcher generates per-run keys)"
            )
        self.rank = rank
        self.vocab_size = vocab_size
        self.timeout_s = cfg.timeout_s
        self.first_timeout_s = cfg.first_batch_timeout_s
        self.max_bytes = cfg.max_message_bytes or DEFAULT_MAX_FRAME_BYTES
        self._received_any = False
        self.address = f"tcp://{cfg.host}:{cfg.port + rank}"
        self.log = log
        self._ctx = zmq.Context()  # own context: closing it never touches other sockets
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        if cfg.curve_client_secret is not None:
            secret = cfg.curve_client_secret.encode()
            self._sock.setsockopt(zmq.CURVE_SERVERKEY, cfg.curve_server_public.encode())
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, zmq.curve_public(secret))
        self._monitor = self._sock.get_monitor_socket(_WATCHED)
        self._reconnect_at: float | None = None
        self._sock.connect(self.address)  # zmq reconnects by itself if the peer is not up yet

    def receive(self, step: int) -> TrainBatch:
        """The next valid batch for ``step``; invalid frames are logged and skipped.

        Raises TimeoutError when no valid batch arrives within ``timeout_s`` in total
        (``first_batch_timeout_s`` for the first one, which waits for inference to start).
        """
        timeout_s = self.timeout_s if self._received_any else self.first_timeout_s
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        logged: set[int] = set()  # a peer that keeps failing is logged once per kind
        while True:
            now = time.monotonic()
            if self._reconnect_at is not None and now >= self._reconnect_at:
                self._reconnect()
            until = min(deadline, self._reconnect_at or deadline)
            ready = dict(poller.poll(timeout=max(1, int((until - now) * 1000)))) if now < deadline else {}
            if self._monitor in ready:
                self._on_event(step, logged)
                continue
            if self._sock not in ready:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no batch for step {step} from {self.address} within {timeout_s:g}s")
                continue
            frames = self._sock.recv_multipart(copy=False)  # decoded from libzmq's buffer: no extra copy of the frame
            try:
                if len(frames) != 1:
                    raise WireError(f"expected a single-frame message, got {len(frames)} frames")
                batch = decode_batch(frames[0].buffer, expected_step=step, expected_rank=self.rank, vocab_size=self.vocab_size)
                self._received_any = True
                return batch
            except WireError as e:
                self.log(f"rejected a message on {self.address} while waiting for step {step}: {e}")

    def _on_event(self, step: int, logged: set[int]) -> None:
        """Log a dropped connection or failed handshake (once per kind in ``logged``) and plan
        to reconnect; libzmq's own reconnect (CONNECT_RETRIED) makes ours unneeded."""
        event = recv_monitor_message(self._monitor)["event"]
        if event == zmq.EVENT_CONNECT_RETRIED:
            self._reconnect_at = None
            return
        if event == zmq.EVENT_DISCONNECTED:
            self._reconnect_at = time.monotonic() + RECONNECT_S
        if event in logged:
            return
        logged.update([event, zmq.EVENT_DISCONNECTED])  # a failed handshake ends in a disconnect too
        why = {
            zmq.EVENT_DISCONNECTED: f"a frame above transport.max_message_bytes ({self.max_bytes}), or the orchestrator went away",
            zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the orchestrator refused this trainer's CURVE key (another run's keys?)",
        }.get(event, "the CURVE handshake failed (the peer holds another server key, or speaks no CURVE)")
        self.log(f"connection to {self.address} dropped while waiting for step {step}: {why}; reconnecting")

    def _reconnect(self) -> None:
        self._reconnect_at = None
        try:
            self._sock.disconnect(self.address)
        except zmq.ZMQError:  # the endpoint is gone already
            pass
        self._sock.connect(self.address)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> BatchReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class MicroTensors:
    """One micro-batch: B samples right-padded to T positions, and the rows the model runs.

    The model rows (``trainer.packing``) are the samples themselves (right-padded,
    ``model_mask`` [R, L] 1 on real tokens), or rows that each hold several blocks (samples,
    shared-prefix groups) back to back (``model_mask`` [R, 1, L, L] bool, query by key), or,
    for the variable-length kernel, one unpadded row (``model_mask`` None, the blocks'
    boundaries in ``cu_seqlens``). ``source`` maps each sample position to the model
    position that holds its token, so the logits there score the next one.
    """

    input_ids: torch.Tensor  # [B, T] int64, pad_id after each sample's end
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] bool, policy tokens (0 on prompt and padding)
    inference_logprobs: torch.Tensor  # [B, T] float32, logprob of token t when sampled
    advantages: torch.Tensor  # [B] float32
    num_truncated: int  # samples cut to seq_len
    model_ids: torch.Tensor  # [R, L] int64
    model_positions: torch.Tensor  # [R, L] int64, restarting at 0 with every sample
    model_mask: torch.Tensor | None  # [R, L] int64, or [R, 1, L, L] bool, or None (varlen)
    source: torch.Tensor  # [B, T] int64, flat index into R * L
    num_model_tokens: int  # tokens the model computes (a shared prefix once), padding excluded
    cu_seqlens: torch.Tensor | None = None  # [S + 1] int32 block boundaries of the varlen row
    max_seqlen: int = 0  # longest block of the varlen row
    teacher_logprobs: torch.Tensor | None = None  # [B, T] float32 like inference_logprobs; None = no teacher
    # The teacher's top-k at the N loss tokens (loss_mask[:, 1:] row-major): ids int64 / logprobs float32 [N, K]
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None
    traces: list[tuple[str, int] | None] | None = None  # each sample's (trace id, part) when traced (``trainer.traces``)

    @property
    def num_real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def head_query(self, temperature: float) -> HeadQuery:
        """What the model's head scores (``trainer.head``): at every loss token, in row-major
        (sample, position) order, the position holding the token before it and the token itself;
        with the teacher's top-k there (``teacher_top_ids`` rows follow the same order)."""
        loss_mask = self.loss_mask[:, 1:]
        return HeadQuery(
            positions=self.source[:, :-1][loss_mask], targets=self.input_ids[:, 1:][loss_mask], temperature=temperature,
            top_ids=self.teacher_top_ids, top_logprobs=self.teacher_top_logprobs,
        )


def right_pad(rows: list[np.ndarray], fill, dtype) -> np.ndarray:
    """Stack 1-d rows into [B, max length], filling each row's tail with ``fill``."""
    out = np.full((len(rows), max(len(r) for r in rows)), fill, dtype=dtype)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


def micro_batches(batch: TrainBatch, seq_len: int, budget: int, share_prefix: bool) -> list[MicroBatch]:
    """A rank's samples of a step (however the orchestrator chunked them on the wire) cut into
    micro-batches of at most ``budget`` model tokens (``trainer.micro_batch_tokens``,
    ``packing.plan_micro_batches``): memory is bounded by tokens, not by a count of samples
    whose lengths may range from ten tokens to ``seq_len``."""
    samples = [s for m in batch.micro_batches for s in m.samples]
    arrays = [sample_arrays(s) for s in samples]
    ids, masks = [a[0][:seq_len] for a in arrays], [a[1][:seq_len] for a in arrays]
    return [MicroBatch(samples=[samples[i] for i in group]) for group in plan_micro_batches(ids, masks, budget, share_prefix)]


def collate(
    micro: MicroBatch, seq_len: int, pad_id: int, device: torch.device,
    share_prefix: bool = False, pack: bool = False, varlen: bool = False,
) -> MicroTensors:
    """Right-pad a micro-batch's samples into tensors (samples longer than seq_len are cut),
    and lay out the model rows (``trainer.packing``): blocks (shared prefixes where they pay,
    with ``share_prefix``), one per row or packed (``pack``), for a mask or for the
    variable-length kernel (``varlen``: one unpadded row, no shared prefix, no mask)."""
    arrays = [sample_arrays(s) for s in micro.samples]
    ids, masks, logprobs = ([a[i][:seq_len] for a in arrays] for i in range(3))
    teacher = teacher_rows(micro, seq_len)
    top = teacher_top_rows(micro, masks)
    varlen = varlen and pack
    blocks = plan_blocks(ids, masks, share_prefix and not varlen)
    sizes = [b.length([len(x) for x in ids]) for b in blocks]
    layout = lay_out(ids, blocks, plan_rows(sizes, row_budget(sizes, pack, varlen)), pad_id)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    boundaries = varlen_boundaries(layout) if varlen else None
    return MicroTensors(
        input_ids=tensor(right_pad(ids, pad_id, np.int64)),
        attention_mask=tensor(right_pad([np.ones(len(r)) for r in ids], 0, np.int64)),
        loss_mask=tensor(right_pad(masks, False, bool)),
        inference_logprobs=tensor(right_pad(logprobs, 0.0, np.float32)),
        advantages=torch.tensor([s.advantage for s in micro.samples], dtype=torch.float32, device=device),
        num_truncated=sum(len(a[0]) > seq_len for a in arrays),
        model_ids=tensor(layout.ids),
        model_positions=tensor(layout.positions),
        model_mask=None if varlen else model_mask(layout, device),
        source=tensor(layout.source),
        num_model_tokens=int((layout.segments >= 0).sum()),
        cu_seqlens=None if boundaries is None else tensor(boundaries),
        max_seqlen=0 if boundaries is None else int(np.diff(boundaries).max()),
        teacher_logprobs=None if teacher is None else tensor(right_pad(teacher, 0.0, np.float32)),
        teacher_top_ids=None if top is None else tensor(top[0].astype(np.int64)),
        teacher_top_logprobs=None if top is None else tensor(top[1]),
        traces=[(s.trace_id, s.trace_part) if s.trace_id is not None else None for s in micro.samples],
    )


def teacher_top_rows(micro: MicroBatch, masks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """The teacher's top-k (ids int32, logprobs float32, [N, K]) at the micro-batch's N loss
    tokens, in the order the loss visits them (sample by sample, position by position), or
    None when no sample carries them. ``masks``: each sample's loss mask cut at seq_len; a
    sample's rows past the cut, and the row of a token at position 0 (which nothing
    predicts), are dropped."""
    tops = all_or_none([teacher_top_arrays(s) for s in micro.samples], "the teacher's top-k")
    if tops is None:
        return None
    ids, logprobs = [], []
    for (top_ids, top_logprobs), mask in zip(tops, masks):
        first = 1 if len(mask) and mask[0] else 0
        rows = slice(first, int(mask.sum()))
        ids.append(top_ids[rows])
        logprobs.append(top_logprobs[rows])
    return np.concatenate(ids), np.concatenate(logprobs)


def teacher_rows(micro: MicroBatch, seq_len: int) -> list[np.ndarray] | None:
    """Each sample's teacher logprobs cut to seq_len, or None when no sample has any.

    A micro-batch is one loss: its samples are all distilled or none is, so a mix means the
    orchestrator lost some teacher scores and is refused rather than trained half-way."""
    rows = all_or_none([teacher_array(s) for s in micro.samples], "teacher logprobs")
    return None if rows is None else [r[:seq_len] for r in rows]


def all_or_none(values: list, what: str) -> list | None:
    """``values`` when every sample of a micro-batch carries ``what``, None when none does; a
    micro-batch is one loss, so a mix means the orchestrator lost some and is refused."""
    have = sum(v is not None for v in values)
    if have == 0:
        return None
    if have < len(values):
        raise ValueError(f"a micro-batch mixes samples with and without {what} ({have} of {len(values)} have them)")
    return values


def model_mask(layout: Layout, device: torch.device) -> torch.Tensor:
    """[R, L] int64 padding mask when every row holds one plain sample (the attention's own
    causal mask does the rest), else the [R, 1, L, L] bool block mask, built on ``device``
    from the [R, L] block and segment ids (``packing.attention_allowed``)."""
    if layout.shared or layout.packed:
        blocks, segments = (torch.from_numpy(a).to(device) for a in (layout.blocks, layout.segments))
        return attention_allowed(blocks, segments)
    return torch.from_numpy((layout.segments >= 0).astype(np.int64)).to(device)
