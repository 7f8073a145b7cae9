"""genqueue's hidden-states connector: vLLM's example connector, made to work on every backend.

vLLM loads this module by `kv_connector_module_path` inside its own interpreter, so it imports
the standard library, torch and vLLM only. Used with the `extract_hidden_states` speculative
method, it writes each finished request's captured layers as `{"hidden_states": [tokens, layers,
hidden], "token_ids": [tokens]}` (safetensors) under `shared_storage_path`, names the file in
the response's `kv_transfer_params.hidden_states_path`, and holds an exclusive flock on
`<file>.lock` until the file is whole.

Only a request that asks is written: one whose `kv_transfer_params` is a non-empty object (a
capture run's answers and the pre-flight's capture probe send `{"include_output_tokens": true}`).
The parent writes a file for every request, and one for a request its client gave up on (an
abort), whose response, and so the file's name, no one ever reads: on an engine that captures,
every other request (a probe, a health check, another run's answers, a streamed pre-flight closed
at its first chunk) would leave a file on the engine's disk for good.

The parent copies out of the KV cache on a CUDA stream into pinned memory and waits on a CUDA
event: on a CUDA device that path is kept as it is. Anywhere else (vLLM's CPU backend) there is
no stream, event or pinned memory, so the rows are copied out at once, before the request's
blocks go back to the pool, and the disk write alone goes to the writer threads.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # type: ignore[import-not-found, unused-ignore]
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.request import RequestStatus  # type: ignore[import-not-found, unused-ignore]


def asks(sampling_params: Any) -> bool:
    """Whether a request's sampling parameters carry a non-empty `kv_transfer_params` object
    (vLLM's OpenAI server passes the request's own through `extra_args`, and only when set)."""
    extra = getattr(sampling_params, "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(params, dict) and bool(params)


class CopyDone:
    """The parent's CUDA copy event, for a copy that finished before the event was made: the
    request counts as sent at once, and the writer thread does not wait."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class GenqueueHiddenStatesConnector(ExampleHiddenStatesConnector):  # type: ignore[misc, unused-ignore]
    """ExampleHiddenStatesConnector that writes only what a request asked for and its client will
    read, with a host-side copy wherever the KV cache is not on CUDA."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # worker side: the lock file made for each request whose write has not been submitted
        self._lock_paths: dict[str, str] = {}

    # scheduler side

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """The parent's, less the requests that did not ask: they get no file name, so no lock
        file, no delayed block freeing and no write."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            if not asks(new_req.sampling_params):
                self._request_filenames.pop(new_req.req_id, None)
                if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                    meta.new_req_filenames.pop(new_req.req_id, None)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The parent's, but an aborted request is not written: its client is gone, and the
        file would be named to no one."""
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._request_filenames.pop(request.request_id, None)
            self._pending_saves.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)  # type: ignore[no-any-return]

    # worker side

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self._is_tp_rank_zero and self.use_lock and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for req_id, filename in meta.new_req_filenames.items():
                    self._lock_paths.setdefault(req_id, filename + ".lock")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The parent's; then the lock file of a request that finished without a write (an
        abort) goes too: the parent closes it and leaves it on disk."""
        done = super().get_finished(finished_req_ids)
        for req_id in [r for r in self._lock_paths if r not in self._lock_fds]:
            try:
                os.unlink(self._lock_paths.pop(req_id))
            except FileNotFoundError:
                pass
        return done  # type: ignore[no-any-return]

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        self._lock_paths.pop(pending.req_id, None)  # written: its lock is the reader's to remove
        kv_cache = self._kv_cache
        if kv_cache is None:
            raise RuntimeError("hidden-states connector: no KV cache registered before a request finished")
        if kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        if slots.numel() < num_tokens:
            raise RuntimeError(f"hidden-states connector: request {pending.req_id} has {num_tokens} tokens "
                               f"but blocks for {slots.numel()}")
        # A copy of its own (clone): once this returns, the blocks may be handed to other requests.
        hidden_states = extract_from_kv_cache(kv_cache, slots.to(kv_cache.device), num_tokens).to("cpu").clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        if pending.req_id in self._req_futures:
            raise RuntimeError(f"hidden-states connector: a second write for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
