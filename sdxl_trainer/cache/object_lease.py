"""An exclusive lease on an object, for object storage, which has no locks (ObjectLease)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from sdxl_trainer.cache.errors import CacheError, StorageError
from sdxl_trainer.cache.s3_store import RemoteStore
from sdxl_trainer.runtime.files import LockHeld

# A lease object (ObjectLease) is renewed every LEASE_RENEW_S; one not renewed for LEASE_S was left by a killed process.
LEASE_RENEW_S = 60.0
LEASE_S = 300.0


class LeaseLost(CacheError):
    """Another process took over this process's ObjectLease; the message names it."""


class ObjectLease:
    """An exclusive lease on the object `name`, for object storage, which has no locks: the object records
    "process PID on HOST" and when it was last renewed (this machine's clock). Every write of it is conditional
    on the version last seen (RemoteStore.write_if), so of two processes taking it at once, or over each other,
    exactly one succeeds. A thread renews it every `renew_s`; a lease not renewed for `lease_s` (its process was
    killed or stalled) is taken over. Raises LockHeld while another process holds it.

    A holder that stalled past `lease_s` may find its lease taken over: its renewal fails, it stops renewing,
    and confirm(), which its work calls before each commit, raises LeaseLost."""

    def __init__(self, store: RemoteStore, name: str, lease_s: float = LEASE_S, renew_s: float = LEASE_RENEW_S):
        self.store, self.name, self.lease_s = store, name, lease_s
        self.holder = f"process {os.getpid()} on {socket.gethostname()}"
        self.token = uuid.uuid4().hex
        self._renewing = threading.Lock()  # the renewer thread and confirm() both write it
        self._lost: LeaseLost | None = None
        self._version = self._take(lease_s)
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_every, args=(renew_s,), name=f"lease {name}", daemon=True)
        self._renewer.start()

    def _record(self) -> bytes:
        return json.dumps({"holder": self.holder, "token": self.token, "renewed_at": time.time()}).encode()

    def _read(self) -> tuple[dict, str] | None:
        found = self.store.read_versioned(self.name)
        if found is None:
            return None
        data, version = found
        try:
            record = json.loads(data)
            float(record["renewed_at"])
        except (ValueError, KeyError, TypeError):
            record = {"holder": "an unreadable lease", "renewed_at": 0.0}
        return record, version

    def _take(self, lease_s: float) -> str:
        version = self.store.write_if(self.name, self._record(), None)
        if version is not None:
            return version
        found = self._read()
        if found is None:  # released between the two requests: free again
            version = self.store.write_if(self.name, self._record(), None)
            if version is None:
                raise LockHeld("another process that took the lease just now")
            return version
        current, version = found
        if current.get("token") == self.token:  # this write's answer was lost and its retry refused: it is this process's own
            return version
        age = time.time() - current["renewed_at"]
        if age < lease_s:
            raise LockHeld(f"{current['holder']} (its lease {self.store.location(self.name)} was renewed {age:.0f} s ago; if that process is gone, delete it)")
        version = self.store.write_if(self.name, self._record(), version)  # a killed process's lease, unless another took it first
        if version is None:
            raise LockHeld("another process taking over the same stale lease")
        return version

    def confirm(self) -> None:
        """Renew the lease now: no other process can take it over for `lease_s` from here. Raises LeaseLost if
        another process has taken it over (StorageError if the storage cannot be reached)."""
        with self._renewing:
            if self._lost is None:
                version = self.store.write_if(self.name, self._record(), self._version)
                if version is None:
                    self._lost = self._loss()
                else:
                    self._version = version
            if self._lost is not None:
                raise self._lost

    def _loss(self) -> LeaseLost | None:
        """Why the last renewal failed; None where the lease is still this process's (a renewal whose answer was
        lost and whose retry was refused), its version then taken up."""
        found = self._read()
        if found is not None and found[0].get("token") == self.token:
            self._version = found[1]
            return None
        what = f"was taken over by {found[0]['holder']}" if found is not None else "was deleted"
        return LeaseLost(
            f"the lease {self.store.location(self.name)} {what}, as this process had not renewed it for {self.lease_s:.0f} s (it was "
            "stalled): stopping before its next write, so that two processes do not write the same files"
        )

    def _renew_every(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.confirm()
            except LeaseLost:
                return  # the work stops at its next confirm()
            except StorageError:
                pass  # the next renewal tries again; the lease lasts LEASE_S

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        if self._lost is not None:
            return  # another process's lease now
        try:
            self.store.remove_if(self.name, self._version)
        except StorageError:
            pass  # unreachable storage: the lease lapses by itself after LEASE_S
