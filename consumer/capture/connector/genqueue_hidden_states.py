"""genqueue's hidden-states connector: vLLM's example connector, made to work on every backend.

vLLM loads this module by `kv_connector_module_path` inside its own interpreter, so it imports
the standard library, torch and vLLM only. Used with the `extract_hidden_states` speculative
method, it writes each finished request's captured layers as `{"hidden_states": [tokens, layers,
hidden], "token_ids": [tokens]}` (safetensors) under `shared_storage_path`, names the file in
the response's `kv_transfer_params.hidden_states_path`, and holds an exclusive flock on
`<file>.lock` until the file is whole.

The parent copies out of the KV cache on a CUDA stream into pinned memory and waits on a CUDA
event: on a CUDA device that path is kept as it is. Anywhere else (vLLM's CPU backend) there is
no stream, event or pinned memory, so the rows are copied out at once, before the request's
blocks go back to the pool, and the disk write alone goes to the writer threads.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # type: ignore[import-not-found, unused-ignore]
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CopyDone:
    """The parent's CUDA copy event, for a copy that finished before the event was made: the
    request counts as sent at once, and the writer thread does not wait."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class GenqueueHiddenStatesConnector(ExampleHiddenStatesConnector):  # type: ignore[misc, unused-ignore]
    """ExampleHiddenStatesConnector with a host-side copy wherever the KV cache is not on CUDA."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
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
