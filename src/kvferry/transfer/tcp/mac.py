"""Message tags of the authenticated TCP data plane: AES-256-GMAC, or HMAC-SHA256 where GMAC is missing.

A tag covers one message (or reply) and its sequence number; the key belongs to one connection and one
direction (see `tcp_auth`), so a tag never verifies on another connection, at another position or in
the other direction.

Why GMAC: measured on the 2-core dev box (SHA-NI, AVX-512, OpenSSL 3.0), per 2 KiB / 16 KiB / 1 MiB
piece: hmac-sha256 1.5 / 1.5 / 1.6 GB/s, keyed blake2b 0.8 / 0.7 / 1.0, keyed blake2s 0.4-0.6,
sha512 0.6-0.8, sha3-256 0.3-0.5, AES-256-GMAC 5.6 (pieces gathered first) / 8.3 / 12-13 GB/s.
GMAC (NIST SP 800-38D: GCM with everything as associated data) is a standard MAC; its one rule is a
unique IV per key, here the sequence number under a per-connection key. hashlib has no GMAC, so it is
called in the libcrypto that hashlib itself loaded (ctypes, GIL released during each call); it must
pass a known-answer test at import, else this side offers only HMAC-SHA256 (truncated to 128 bits,
through `hmac`) and sessions with it use that.

Both read memory by address (the receiver what landed in registered regions, the sender its source
regions); pieces under 8 KiB are first gathered into one buffer, since one call costs about a
microsecond. Callers pass only ranges they already checked against their region.
"""

from __future__ import annotations

import ctypes
import hmac
import weakref

from kvferry.transfer.tcp import wire

_CHUNK = 1 << 30  # EVP_EncryptUpdate takes an int length
_JOIN_BELOW = 8 << 10  # pieces smaller than this are gathered (one memcpy) and hashed in one call...
_JOIN_BATCH = 512 << 10  # ... this many bytes at a time: a call costs ~1 us, a 2 KiB piece's GHASH less
_GET_TAG = 0x10  # EVP_CTRL_GCM_GET_TAG
# GCM spec test case 13: AES-256, zero key, zero IV, nothing authenticated.
_KAT_TAG = bytes.fromhex("530f8afbc74536b9a963b4f1c4cb738b")


class Mac:
    """Tags with one key: `start(seq)`, any `update`/`update_at`, then `finish()`."""

    def start(self, seq: int) -> None:
        raise NotImplementedError

    def update(self, data: bytes) -> None:
        raise NotImplementedError

    def update_at(self, addr: int, n: int) -> None:
        """Feed `n` bytes of memory starting at address `addr` (a checked range of a live buffer)."""
        raise NotImplementedError

    def update_pieces(self, views: list[memoryview], addrs: list[int]) -> None:
        """Feed the pieces in order; `addrs[i]` is where `views[i]` starts in memory."""
        for addr, v in zip(addrs, views, strict=True):
            self.update_at(addr, v.nbytes)

    def finish(self) -> bytes:
        raise NotImplementedError

    def tag(self, seq: int, data: bytes) -> bytes:
        self.start(seq)
        self.update(data)
        return self.finish()


class HmacSha256(Mac):
    def __init__(self, key: bytes) -> None:
        self._key = key
        self._h = hmac.new(key, digestmod="sha256")

    def start(self, seq: int) -> None:
        self._h = hmac.new(self._key, seq.to_bytes(8, "little"), "sha256")

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def update_at(self, addr: int, n: int) -> None:
        for off in range(0, n, _CHUNK):
            k = min(_CHUNK, n - off)
            self._h.update((ctypes.c_char * k).from_address(addr + off))  # a view, not a copy

    def update_pieces(self, views: list[memoryview], addrs: list[int]) -> None:
        update = self._h.update
        for v in views:
            update(v)

    def finish(self) -> bytes:
        return self._h.digest()[: wire.TAG_BYTES]


def _libcrypto() -> ctypes.CDLL | None:
    """The libcrypto that hashlib loaded into this process (Linux), so the very library Python trusts.

    No search elsewhere: loading some other libcrypto (macOS aborts on its unversioned one) is worse
    than the HMAC fallback.
    """
    try:
        import _hashlib  # noqa: F401 - loads libcrypto into this process

        with open("/proc/self/maps") as f:
            path = next((ln.split()[-1] for ln in f if "/libcrypto.so" in ln), None)
    except (ImportError, OSError):
        return None
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        vp, ci = ctypes.c_void_p, ctypes.c_int
        lib.EVP_CIPHER_CTX_new.restype = vp
        lib.EVP_CIPHER_CTX_new.argtypes = []
        lib.EVP_CIPHER_CTX_free.argtypes = [vp]
        lib.EVP_aes_256_gcm.restype = vp
        lib.EVP_aes_256_gcm.argtypes = []
        lib.EVP_EncryptInit_ex.argtypes = [vp, vp, vp, ctypes.c_char_p, ctypes.c_char_p]
        lib.EVP_EncryptUpdate.argtypes = [vp, vp, ctypes.POINTER(ci), vp, ci]
        lib.EVP_EncryptFinal_ex.argtypes = [vp, vp, ctypes.POINTER(ci)]
        lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, ci, ci, vp]
    except (OSError, AttributeError):
        return None
    return lib


class Gmac(Mac):
    """AES-256-GCM over associated data only; IV = the sequence number (unique per key)."""

    def __init__(self, lib: ctypes.CDLL, key: bytes) -> None:
        self._lib = lib
        self._key = key
        self._ctx = lib.EVP_CIPHER_CTX_new()
        if not self._ctx:
            raise MemoryError("EVP_CIPHER_CTX_new")
        weakref.finalize(self, lib.EVP_CIPHER_CTX_free, self._ctx)
        self._cipher = lib.EVP_aes_256_gcm()
        self._outl = ctypes.c_int(0)
        self._outl_ref = ctypes.byref(self._outl)
        self._buf = ctypes.create_string_buffer(32)
        self._update = lib.EVP_EncryptUpdate

    def start(self, seq: int) -> None:
        iv = seq.to_bytes(12, "little")
        if self._lib.EVP_EncryptInit_ex(self._ctx, self._cipher, None, self._key, iv) != 1:
            raise RuntimeError("EVP_EncryptInit_ex failed")

    def update(self, data: bytes) -> None:
        if data and self._update(self._ctx, None, self._outl_ref, data, len(data)) != 1:
            raise RuntimeError("EVP_EncryptUpdate failed")

    def update_at(self, addr: int, n: int) -> None:
        for off in range(0, n, _CHUNK):
            if self._update(self._ctx, None, self._outl_ref, addr + off, min(_CHUNK, n - off)) != 1:
                raise RuntimeError("EVP_EncryptUpdate failed")

    def update_pieces(self, views: list[memoryview], addrs: list[int]) -> None:
        total = sum(v.nbytes for v in views)
        if views and total < _JOIN_BELOW * len(views):  # small pieces: gather, then few calls
            step = max(1, _JOIN_BATCH * len(views) // total)
            for a in range(0, len(views), step):
                self.update(b"".join(views[a : a + step]))
            return
        update, ctx, outl = self._update, self._ctx, self._outl_ref
        for addr, v in zip(addrs, views, strict=True):
            n = v.nbytes
            if n >= _CHUNK:
                self.update_at(addr, n)
            elif update(ctx, None, outl, addr, n) != 1:
                raise RuntimeError("EVP_EncryptUpdate failed")

    def finish(self) -> bytes:
        lib = self._lib
        if lib.EVP_EncryptFinal_ex(self._ctx, self._buf, self._outl_ref) != 1:
            raise RuntimeError("EVP_EncryptFinal_ex failed")
        if lib.EVP_CIPHER_CTX_ctrl(self._ctx, _GET_TAG, wire.TAG_BYTES, self._buf) != 1:
            raise RuntimeError("EVP_CTRL_GCM_GET_TAG failed")
        return self._buf.raw[: wire.TAG_BYTES]


def _self_test(lib: ctypes.CDLL) -> bool:
    try:
        if Gmac(lib, bytes(32)).tag(0, b"") != _KAT_TAG:
            return False
        # Pieces fed through both entry points must give the tag of the whole.
        data = bytes(range(256)) * 5
        whole = Gmac(lib, b"k" * 32).tag(7, data)
        mac = Gmac(lib, b"k" * 32)
        mac.start(7)
        mac.update(data[:13])
        buf = ctypes.create_string_buffer(data[13:], len(data) - 13)
        mac.update_at(ctypes.addressof(buf), len(data) - 13)
        return mac.finish() == whole != Gmac(lib, b"k" * 32).tag(8, data)
    except (RuntimeError, MemoryError, OSError):
        return False


_LIB = _libcrypto()
GMAC_AVAILABLE = _LIB is not None and _self_test(_LIB)


def new_mac(key: bytes, gmac: bool) -> Mac:
    if gmac and _LIB is not None and GMAC_AVAILABLE:
        return Gmac(_LIB, key)
    return HmacSha256(key)
