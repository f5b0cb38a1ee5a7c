"""ZeRO-3 with the optimizer on the CPU: the chunked optimizer step runs on a worker thread beside the
next forward (registry: offload_overlap; needs offload_chunks_zero3 and cpu_adam_nogil).

The host's Adam pass is bound by memory bandwidth and the next forward used to wait for all of it. Here
the step does on the main thread what must happen at once (overflow check, global norm, counting the
Adam step and reading its rate) and hands the chunks, in the order the model first uses their
parameters, to a worker. A parameter is gathered only after every chunk of its partition is updated:
each parameter's all_gather and all_gather_coalesced wait for it (the device waits on the chunk's
copies). What reads or writes the optimizer's host buffers (the next backward's gradient copies, the
next step, state_dict, load_state_dict, save_checkpoint, load_checkpoint) waits for the whole step. Only
the main thread talks to other ranks; the worker runs DeepSpeed's CPU Adam kernel through the GIL-free
binding (cpu_adam_nogil.py). The arithmetic is the chunked step's (tests/test_offload_step_zero3.py).
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import sys
import threading
import time
import types

from dstrain.speedups.offload_chunked_step_zero3 import begin_step, chunk_updater, warn_on_allocator_flushes


# The worker takes the GIL back after each chunk's update (about 50 a step at 406M). While the training
# thread runs Python (DeepSpeed's hooks in the forward) it waits up to the interpreter's switch interval
# for it, 5 ms by default; at this interval those hand-offs cost at most a few ms a step.
GIL_SWITCH_INTERVAL_S = 0.00025


def applies(engine) -> str | None:
    """Why the step cannot run beside the next forward on `engine` (None: it can): it needs a CPU or CUDA
    accelerator (the worker's stream and events are CUDA's) and a DeepSpeed with the pieces it wraps
    (dstrain's chunked step, its prerequisite, covers the rest)."""
    optimizer = getattr(engine, "optimizer", None)
    needed = ("fp16_partitioned_groups", "reset_cpu_buffers", "invalidate_secondary_tensor", "partition_grads",
              "state_dict", "load_state_dict")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        return f"this DeepSpeed's optimizer lacks {', '.join(missing)}"
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() not in ("cpu", "cuda"):
        return f"a {get_accelerator().device_name()} accelerator (the worker's stream and events are CUDA's)"
    return None


def install(engine, state, threads: int = 0, quick_gil_handoff: bool = True) -> str | None:
    """Run `engine`'s chunked ZeRO-3 offload step beside the next forward, on `threads` CPU threads (0: one
    fewer than the rank's, leaving a core to the main thread), with dstrain's Adam op (state.adam_op: DeepSpeed's
    binding would stop the training thread during every update); why not (nothing changed) where the
    optimizer's partitions are not laid out as expected. `quick_gil_handoff` shortens the interpreter's
    switch interval to GIL_SWITCH_INTERVAL_S (for the whole process)."""
    optimizer = engine.optimizer
    layout = chunk_layout(optimizer, engine.module)
    if layout is None:
        return "a partition is not where its sub-group's flat buffer says"
    order, ready_after = layout
    overlap = StepBesideForward(order, ready_after, _accelerator_device(optimizer), threads)
    overlap.adam_op = state.adam_op
    for param in engine.module.parameters():
        if hasattr(param, "all_gather") and hasattr(param, "all_gather_coalesced"):
            _gate_gathers(param, overlap)
    for owner, name in ((optimizer, "partition_grads"), (optimizer, "state_dict"), (optimizer, "load_state_dict"),
                        (engine, "save_checkpoint"), (engine, "load_checkpoint")):
        setattr(owner, name, _after_drain(overlap, getattr(owner, name)))
    state.overlap = overlap
    optimizer.step = types.MethodType(_overlapped_step, optimizer)
    atexit.register(overlap.drain_at_exit)
    if quick_gil_handoff:
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
    return None


def chunk_layout(optimizer, module):
    """(order, ready_after): the chunks (sub_group, start, end) in the order the step updates them, and for
    each parameter (by ds_id) the position in that order of the last chunk holding its partition. None
    if a partition is not where the sub-group's flat buffer says."""
    first_use: dict[int, int] = {}
    for submodule in module.modules():  # registration order: the order a forward uses them, for most models
        for param in submodule.parameters(recurse=False):
            first_use.setdefault(id(param), len(first_use))
    unused = len(first_use)
    chunk = optimizer.dstrain_speedups.chunk
    keyed, spans, sizes = [], {}, []
    for sub_group, params in enumerate(optimizer.fp16_groups):
        flat = optimizer.fp16_partitioned_groups_flat[sub_group]
        sizes.append(flat.numel())
        firsts = [unused] * (-(-flat.numel() // chunk))
        offset = 0
        for param, partition in zip(params, optimizer.fp16_partitioned_groups[sub_group]):
            numel = partition.numel()
            if partition.data_ptr() != flat.data_ptr() + offset * flat.element_size():
                return None
            if numel:
                first, last = offset // chunk, (offset + numel - 1) // chunk
                for index in range(first, last + 1):
                    firsts[index] = min(firsts[index], first_use.get(id(param), unused))
                spans[param.ds_id] = (sub_group, first, last)
            offset += numel
        keyed += [(used, sub_group, index) for index, used in enumerate(firsts)]
    keyed.sort()
    position = {(sub_group, index): at for at, (_, sub_group, index) in enumerate(keyed)}
    order = [(sub_group, index * chunk, min((index + 1) * chunk, sizes[sub_group])) for _, sub_group, index in keyed]
    ready_after = {ds_id: max(position[(sub_group, index)] for index in range(first, last + 1))
                   for ds_id, (sub_group, first, last) in spans.items()}
    return order, ready_after


class StepBesideForward:
    """The worker thread that updates the chunks of one step after another, and the waits on it."""

    def __init__(self, order, ready_after: dict, device, threads: int = 0):
        self.order, self.ready_after, self.device, self.threads = order, ready_after, device, threads
        self.adam_op = None  # DeepSpeed's Adam kernel with the GIL released (cpu_adam_nogil.py)
        self.queued = len(order)  # chunks of the current step updated on the host, their copies queued
        self.events: list = []  # per queued chunk: an event after its copies (None where there are none)
        self.running = False
        self.error: BaseException | None = None
        self.steps = 0  # steps the worker finished
        self.waits = 0  # gathers that had to wait for the worker
        self.waited_s = 0.0  # the training thread's time in those waits, in all
        self.update_s = 0.0  # the worker's time on the last step it finished
        self._changed = threading.Condition()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = None
        self._thread = threading.Thread(target=self._work, name="dstrain-offload-step", daemon=True)
        self._thread.start()

    def stream_context(self):
        """The worker's stream, made current (nothing on a CPU accelerator)."""
        if self.device is None:
            return contextlib.nullcontext()
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._stream)

    def start(self, updaters) -> None:
        """Update each chunk with updaters[sub_group](start, end), in order, on the worker."""
        self.raise_error()
        with self._changed:
            self.queued, self.events, self.running = 0, [], True
        self._jobs.put(updaters)

    def wait_for(self, params) -> None:
        """Return once every parameter in `params` has its partition updated on the host, with the current
        stream ordered after the copies of its bf16 values (the gather that follows reads them)."""
        if not self.running:
            self.raise_error()
            return
        need = max((self.ready_after.get(getattr(p, "ds_id", None), -1) for p in params), default=-1)
        if need < 0:
            return
        with self._changed:
            if self.queued <= need:
                self.waits += 1
                started = time.perf_counter()
                while self.queued <= need and self.error is None:
                    self._changed.wait()
                self.waited_s += time.perf_counter() - started
            event = self.events[need] if self.queued > need else None
        self.raise_error()
        if event is not None:  # the device waits, not the host: copies of later chunks keep flowing
            import torch

            torch.cuda.current_stream(self.device).wait_event(event)

    def drain(self) -> None:
        """Return once the step in progress (if any) has finished."""
        with self._changed:
            while self.running and self.error is None:
                self._changed.wait()
        self.raise_error()

    def drain_at_exit(self) -> None:
        with contextlib.suppress(BaseException):
            self.drain()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError("dstrain's overlapped CPU-offload optimizer step failed on its worker thread "
                               "(speedups.offload_overlap=false runs the step on the main thread)") from self.error

    def _work(self) -> None:
        import torch

        if self.device is not None:
            torch.cuda.set_device(self.device)
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        elif torch.get_num_threads() >= 4:  # leave a core to the main thread, which launches the forward
            torch.set_num_threads(torch.get_num_threads() - 1)
        while True:
            updaters = self._jobs.get()
            try:
                self._update_all(updaters)
            except BaseException as error:  # handed to the main thread at its next wait
                with self._changed:
                    self.error, self.running = error, False
                    self._changed.notify_all()

    def _update_all(self, updaters) -> None:
        import torch

        started = time.perf_counter()
        event = None
        for position, (sub_group, start, end) in enumerate(self.order):
            with self.stream_context():
                updaters[sub_group](start, end)
                if self.device is not None:
                    event = torch.cuda.Event()
                    event.record()
            with self._changed:
                self.events.append(event)
                self.queued = position + 1
                self._changed.notify_all()
        if event is not None:  # the step is over once its last copy has landed
            event.synchronize()
        with self._changed:
            self.running = False
            self.steps += 1
            self.update_s = time.perf_counter() - started
            self._changed.notify_all()


def _overlapped_step(self, closure=None):
    """The chunked step, with the chunks handed to the worker; DeepSpeed's _post_step without the persistent
    parameters' all-gather (_partition_all_parameters released them; the next forward gathers them)."""
    overlap = self.dstrain_speedups.overlap
    overlap.drain()
    factor = begin_step(self)
    if factor is None:
        return
    for sub_group_id in range(len(self.fp16_groups)):  # views into the flat partitions: values land later
        self._unflatten_partitioned_parameters(sub_group_id)
    with overlap.stream_context():  # staging made on the worker's stream
        updaters = [chunk_updater(self, sub_group_id, factor, overlap.adam_op)
                    for sub_group_id in range(len(self.fp16_groups))]
    overlap.start(updaters)
    self.reset_cpu_buffers()
    self.invalidate_secondary_tensor()
    warn_on_allocator_flushes(self)


def _gate_gathers(param, overlap: StepBesideForward) -> None:
    gather, gather_coalesced = param.all_gather, param.all_gather_coalesced

    def all_gather(param_list=None, *args, **kwargs):
        overlap.wait_for([param] if param_list is None else param_list)
        return gather(param_list, *args, **kwargs)

    def all_gather_coalesced(params, *args, **kwargs):
        params = list(params)
        overlap.wait_for(params)
        return gather_coalesced(params, *args, **kwargs)

    param.all_gather, param.all_gather_coalesced = all_gather, all_gather_coalesced


def _after_drain(overlap: StepBesideForward, method):
    def drained(*args, **kwargs):
        overlap.drain()
        return method(*args, **kwargs)
    return drained


def _accelerator_device(optimizer):
    """The CUDA device the worker queues copies on; None where the chunks are rounded on the host."""
    if optimizer.dstrain_speedups.round_op is not None:  # rounded by the Adam pass, into host memory
        return None
    staging_on_device = any(m.is_pinned() for m in optimizer.fp32_partitioned_groups_flat)
    if not staging_on_device:
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device())
