"""The job secret, and the MACs an elastic job's members put on what they tell each other (issue 39,
docs/security.md).

Every node holds the same secret (--elastic.secret_file, or $NANOTITAN_ELASTIC_SECRET; a job on one host makes
its own in the run dir). From it each process derives one HMAC-SHA256 key, which signs:
- each request to a node's file transport (transport.py) and each answer: the request's fields, a SHA-256 of
  its body, a timestamp and a nonce (a request older than WINDOW_S or whose nonce was seen is a replay);
  an answer is bound to its request's nonce;
- each store entry a member acts on (SignedStore): the value, bound to its full key (the job's prefix included)
  and to the launch's nonce, so an entry cannot be forged, moved to another key or job, or replayed from an
  earlier launch.
Something without a valid MAC is refused and named in one line on the node it reached; the job goes on.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from ..config.config import Config, ConfigError, ElasticConfig
from ..config.errors import first_line
from ..run.loopback import is_loopback, split_endpoint

SECRET_ENV = "NANOTITAN_ELASTIC_SECRET"  # the secret itself (the file's alternative)
KEY_ENV = "NANOTITAN_ELASTIC_KEY"  # the derived key, handed by an agent to its ranks
SECRET_FILE = "elastic.secret"  # RUN_DIR/elastic.secret: a one-host job's own secret (mode 0600)
WINDOW_S = 60.0  # a request whose timestamp is further than this from the server's clock is stale
MIN_SECRET = 16  # bytes: a shorter secret is guessed offline from one signed entry (3 characters: in 0.4 s)
INSECURE_KEY = hashlib.sha256(b"nanotitan-elastic-insecure").digest()  # --elastic.insecure: a key everyone knows


def single_host(endpoint: str) -> bool:
    """Whether an elastic job at HOST:PORT can only have members on this machine (HOST names a loopback address:
    any of 127.0.0.0/8, or ::1)."""
    return is_loopback(split_endpoint(endpoint)[0])


def default_id_warning(cfg: Config) -> str:
    """A warning line when elastic.id is the default (the same for every job), else ''."""
    if cfg.elastic.id != ElasticConfig.id:
        return ""
    return (f"nanotitan elastic: warning: elastic.id is the default {cfg.elastic.id!r}, the same for every job: give "
            "each job its own --elastic.id (it names the job's store keys and snapshot dirs)")


def derive(secret: bytes) -> bytes:
    return hashlib.sha256(b"nanotitan-elastic-v1\0" + secret.strip()).digest()


def job_key(cfg: Config) -> bytes:
    """This job's MAC key, from the first of: --elastic.secret_file, $NANOTITAN_ELASTIC_SECRET, on one host
    RUN_DIR/elastic.secret (made here if absent), --elastic.insecure (a key everyone knows). A job across hosts
    with none of them raises ConfigError naming the option."""
    e = cfg.elastic
    if e.secret_file:
        try:
            with os.fdopen(os.open(e.secret_file, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:  # a FIFO cannot block
                why = _not_own(os.fstat(f.fileno()))
                secret = f.read() if not why else b""
        except OSError as err:
            raise ConfigError(f"elastic.secret_file={e.secret_file!r} is unreadable ({err.strerror}) "
                              "(--elastic.secret_file)") from None
        if why:
            raise ConfigError(f"elastic.secret_file={e.secret_file!r} {why}: chmod 600 {e.secret_file}, as its "
                              "owner (--elastic.secret_file)")
        return derive(_long_enough(secret, f"elastic.secret_file={e.secret_file!r}"))
    if os.environ.get(SECRET_ENV, "").strip():
        return derive(_long_enough(os.environ[SECRET_ENV].encode(), f"${SECRET_ENV}"))
    if single_host(e.endpoint):
        return derive(_own_secret(Path(cfg.run.dir)))
    if e.insecure:
        return INSECURE_KEY
    raise ConfigError(f"an elastic job across hosts (elastic.endpoint={e.endpoint}) needs a job secret, the same "
                      "on every node: --elastic.secret_file PATH (or $NANOTITAN_ELASTIC_SECRET); "
                      "--elastic.insecure true runs without one")


def _long_enough(secret: bytes, where: str) -> bytes:
    """`secret`, or ConfigError when it is shorter than MIN_SECRET bytes: anyone who reads one signed store entry
    (any local user, on one host) can try every short secret against its MAC offline."""
    n = len(secret.strip())
    if n < MIN_SECRET:
        raise ConfigError(f"{where} holds a secret of {n} bytes, fewer than {MIN_SECRET}: one signed entry of the "
                          "job's store lets anyone guess a short one offline; use 32 random bytes "
                          "(head -c 32 /dev/urandom | base64)")
    return secret


def agent_key(cfg: Config) -> bytes:
    """job_key, for an agent: the raw secret then leaves its environment, so the ranks and warm ranks it starts
    (which copy os.environ) get only the derived key (KEY_ENV), never the secret itself."""
    key = job_key(cfg)
    os.environ.pop(SECRET_ENV, None)
    return key


def _not_own(st: os.stat_result) -> str:
    """'' when a secret file with this stat is this user's own (owned by them, no access for group or others),
    else what is wrong: a 0644 secret is readable by every local user, a planted one is someone else's."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"is open to group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _own_secret(run_dir: Path) -> bytes:
    """RUN_DIR/elastic.secret, made (mode 0600, 32 random bytes) by the first agent of a one-host job; the others
    read it. Made under a temporary name and linked into place, so no agent reads a half-written one. An existing
    one must be this user's own regular file, mode 0600 (read through no symlink): one planted by another user
    would be a secret they know."""
    path = run_dir / SECRET_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{SECRET_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        try:
            os.link(tmp, path)  # fails if another agent's is there first: theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise ConfigError(f"{path} is unreadable or a symlink ({err.strerror}): remove it (a one-host job makes a "
                          "new one), or give --elastic.secret_file") from None
    with os.fdopen(fd, "rb") as f:
        if why := _not_own(os.fstat(fd)):
            raise ConfigError(f"{path} {why}: not this user's own secret; remove it (a one-host job makes a new "
                              "one), or give --elastic.secret_file")
        return f.read()


def rank_key() -> bytes:
    """The key a rank's agent handed it (KEY_ENV)."""
    return bytes.fromhex(os.environ[KEY_ENV])


# --- messages of the file transport ------------------------------------------------------------------------

def _mac(key: bytes, fields: dict) -> str:
    payload = json.dumps({k: v for k, v in fields.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def seal(key: bytes, msg: dict, body_sha256: str = "", reply_to: str = "") -> dict:
    """`msg` with a timestamp, a nonce, its body's SHA-256 (hex, '' for none) and their MAC. An answer names the
    nonce of the request it answers (`reply_to`)."""
    msg = dict(msg, ts=time.time(), nonce=secrets.token_hex(16), body=body_sha256, reply_to=reply_to)
    msg["mac"] = _mac(key, msg)
    return msg


def valid(key: bytes, msg) -> bool:
    """Whether `msg` carries a MAC of `key` over its fields. Never raises, whatever a peer sent: compare_digest
    raises TypeError on a non-ASCII str, json.dumps RecursionError on a deep one."""
    mac = msg.get("mac") if isinstance(msg, dict) else None
    if not (isinstance(mac, str) and mac.isascii()):
        return False
    try:
        return hmac.compare_digest(mac, _mac(key, msg))
    except (ValueError, TypeError, RecursionError):
        return False


class ReplayGuard:
    """A server's check of each request: a valid MAC, a fresh timestamp, a nonce not seen within WINDOW_S."""

    def __init__(self, key: bytes):
        self.key, self.seen, self.lock = key, {}, threading.Lock()

    def why_not(self, msg: dict) -> str:
        """'' when the request is to be served, else why it is refused."""
        if not valid(self.key, msg):
            return "no valid MAC (a sender without the job secret)"
        now, ts = time.time(), msg.get("ts")
        if type(ts) not in (int, float) or not now - WINDOW_S <= ts <= now + WINDOW_S:  # NaN, 10**400 too
            return f"a stale timestamp (more than {WINDOW_S:g} s off: a replay, or a clock that is)"
        with self.lock:
            self.seen = {n: t for n, t in self.seen.items() if now - t <= 2 * WINDOW_S}
            if msg.get("nonce") in self.seen:
                return "a nonce already used (a replay)"
            self.seen[msg["nonce"]] = now
        return ""


# --- store entries -----------------------------------------------------------------------------------------

ENTRY_MAX = 64 << 10  # bytes: no entry of ours is larger (a plan is ~1 KB); a larger one is a stranger's
REFUSED_MAX = 256  # refused entries remembered (so each is named once); the oldest is forgotten first
ABSENT = b"\0nanotitan-absent\0"  # compare_set's answer for a missing key (no entry of ours is this)
# Keys a joiner reads before it knows the launch nonce: join/ and assign/ are bound to a fresh random token of the
# joiner's instead; `job` is node 0's word that it coordinates the job (the time on its clock), which a joiner
# checks its secret against while it waits for its id, and node 0 rewrites every second. Everything else (node 0's
# liveness address `live` included) is bound to the launch.
UNBOUND = ("join/", "assign/", "job")


class StoreGone(ConnectionError):
    """A write to the job's store failed: node 0's store no longer answers (node 0 died, or the network is down)."""


def new_launch() -> str:
    """An instance nonce for one launch of a job (node 0 draws it when it starts the store)."""
    return secrets.token_hex(16)


class SignedStore:
    """The job's store (node 0's TCPStore, under the prefix nanotitan/elastic/JOB) with a MAC on each entry.

    `set` writes MAC || value; the MAC covers the full prefixed key (job id included) and this launch's nonce,
    so an entry copied from another job, another key, or an earlier launch of this job (the one-host secret
    persists in the run dir; the id may be the default) does not verify. Keys under UNBOUND carry no launch:
    a joiner learns the launch from them, and their keys hold a random token of its own.

    `get` is one non-blocking read (compare_set: the current value, or ABSENT, with no wait for a key deleted
    meanwhile); an entry over ENTRY_MAX bytes is refused unparsed, the MAC is checked before anything is parsed,
    and the read is wrapped against any exception: a bad entry (or a failed read) reads as absent, named once in
    one line. Counters (`add`) carry no MAC: the
    coordinator acts on no counter alone."""

    def __init__(self, raw, key: bytes, job: str, launch: str | None = None, log=print):
        import torch.distributed as dist

        self.prefix = f"nanotitan/elastic/{job}"
        self.store, self.key, self.launch, self.log = dist.PrefixStore(self.prefix, raw), key, launch, log
        self.refused: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # (key, digest of what was read)

    def _mac(self, k: str, value: str) -> str:
        launch = "" if k.startswith(UNBOUND) else self.launch
        assert launch is not None, f"{k}: this launch's nonce is not known yet"
        payload = json.dumps([f"{self.prefix}/{k}", launch, value])
        return hmac.new(self.key, payload.encode(), hashlib.sha256).hexdigest()

    def set(self, k: str, value: str) -> None:
        try:
            self.store.set(k, self._mac(k, value) + value)
        except Exception as err:  # noqa: BLE001 - torch's DistNetworkError, DistStoreError, a timeout: all one thing
            raise StoreGone(f"node 0's store does not answer ({first_line(err)})") from None

    def get(self, k: str) -> str | None:
        try:
            raw = self.store.compare_set(k, ABSENT, ABSENT)
        except Exception as err:  # noqa: BLE001 - a store error (a timeout, a closed connection) reads as absent
            return self._refuse(k, type(err).__name__.encode(), f"store entry {k!r} is unreadable ({first_line(err)}); "
                                                                "read as absent")
        if raw == ABSENT:
            return None
        if len(raw) > ENTRY_MAX:  # neither parsed nor hashed whole
            return self._refuse(k, hashlib.sha256(raw[:ENTRY_MAX]).digest() + str(len(raw)).encode(),
                                f"refused store entry {k!r}: {len(raw)} bytes, more than {ENTRY_MAX}; ignored")
        try:
            mac, value = raw[:64].decode("ascii"), raw[64:].decode("utf-8")
        except UnicodeDecodeError:  # not ours
            mac = value = ""
        if len(mac) == 64 and hmac.compare_digest(mac, self._mac(k, value)):
            return value
        return self._refuse(k, hashlib.sha256(raw).digest(), f"refused store entry {k!r}: no valid MAC (written "
                            "without the job secret, or by another job or an earlier launch of this one); ignored")

    def _refuse(self, k: str, digest: bytes, line: str) -> None:
        """Name a refused entry once (while it is among the REFUSED_MAX last ones); it reads as absent."""
        seen = (k, digest)
        if seen in self.refused:
            self.refused.move_to_end(seen)
            return None
        self.refused[seen] = None
        if len(self.refused) > REFUSED_MAX:
            self.refused.popitem(last=False)
        self.log(f"nanotitan elastic: {line}")
        return None

    def has(self, k: str) -> bool:
        """Whether anything (signed or not) is at `k`: one non-blocking check, False when the store cannot say."""
        try:
            return self.store.check([k])
        except Exception:  # noqa: BLE001 - a store error is "cannot say", as in `get`
            return False

    def add(self, k: str, n: int) -> int:
        try:
            return self.store.add(k, n)
        except Exception as err:  # noqa: BLE001 - as in `set`
            raise StoreGone(f"node 0's store does not answer ({first_line(err)})") from None
