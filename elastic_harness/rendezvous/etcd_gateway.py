"""etcd's v3 API through its JSON gateway: HTTP POSTs with JSON bodies, no client library.

Why no library (docs/lifecycle.md, "etcd"): the rendezvous needs five calls (``kv/range``,
``kv/txn``, ``lease/grant``, ``lease/keepalive``, ``auth/authenticate``) plus the member
list for the isolation watchdog. Every etcd since 3.4 serves them under ``/v3/`` on its
client port, beside gRPC. The maintained Python clients either speak gRPC (``grpcio`` and a
protobuf pin next to torch's, for five calls; python-etcd3 itself is unmaintained since
2020) or, like OpenStack's etcd3gw, speak this same gateway but one member at a time,
without user/password authentication, through ``requests``. Here: ``http.client`` and
``ssl``, one kept-alive connection per member and thread.

Keys and values travel base64-encoded (the gateway's JSON for ``bytes``); 64-bit numbers
(revisions, lease ids) as decimal strings.

Members: ``Gateway.call`` asks the member that answered last, among those the job named and
those the cluster advertises (``learn_members``); when it cannot be reached (a
refused or timed-out connection, a 5xx, or etcd's own "unavailable"), each other member in
turn, once. A member that answered "unavailable" (a leader election, a quorum being
restored) is asked again, all of them in turn, until ``Settings.timeout`` has passed since the
call began: losing the member that led the cluster is not the job's failure. When no member
answers at all (every one restarting: the only member of a single-member etcd, say), a
gateway that was answered before rides it out for ``Settings.ride_out`` seconds after its
last answer (the job's ``rendezvous.isolation_timeout``), asking again every
``RIDE_OUT_PAUSE_S``; one never answered, or past that, raises ``EtcdUnavailable`` at once
(the infrastructure's failure: worth a retry). An answer that says the job's settings are wrong raises
``EtcdRefused`` with one line naming the fix: no v3 API at that address (an etcd older than
3.4, or one serving only v2, or not etcd), https asked of a plain-http etcd or the reverse,
a certificate it does not accept, wrong credentials, authentication asked of an etcd with
none (or the reverse), a permission the user lacks. Retrying cannot help those.

Authentication: with a user, the gateway first POSTs ``auth/authenticate`` and sends the
token it gets in the ``Authorization`` header. etcd's default ("simple") tokens live in the
member that issued them and expire (``--auth-token-ttl``, 5 minutes): an "invalid auth
token" answer makes it authenticate again with that member and retry once.

Retries are safe because every write the rendezvous makes is a compare-and-swap: a write
that was applied but whose answer was lost fails its compare when repeated, and the caller
reads what is there. This module imports no torch: the isolation watchdog uses it too.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 2.0  # a member that does not accept a connection this fast is skipped
UNAVAILABLE_PAUSE_S = 0.1  # between two rounds of the members while one says it is unavailable
RIDE_OUT_PAUSE_S = 0.5  # between two rounds while no member answers (``Settings.ride_out``)


class EtcdError(Exception):
    """An answer from etcd that is neither success nor a reason to try another member."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code  # etcd's gRPC status code (5: not found, e.g. a lease that expired)


class EtcdUnavailable(EtcdError):
    """No member could be reached (or none could serve): the infrastructure's failure."""


class EtcdRefused(EtcdError):
    """A member answered, and its answer says the job's etcd settings are wrong."""


def b64(data: str | bytes) -> str:
    """Bytes (or UTF-8 text) as the gateway's JSON carries them."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


@dataclass(frozen=True)
class Settings:
    """Where etcd is and how to talk to it (``from_conf`` reads the rendezvous config)."""

    endpoints: tuple[str, ...]  # HOST:PORT of each member a client may use
    protocol: str = "http"  # or https
    ca_cert: str = ""  # https: the CA bundle that signed etcd's certificate ("" = the system's)
    cert: str = ""  # https: this client's certificate (etcd's --client-cert-auth)
    key: str = ""  # its private key ("" = in ``cert``)
    user: str = ""  # etcd authentication: user name ("" = none)
    password: str = ""  # its password (read from the job's password file, never the spec)
    timeout: float = 10.0  # seconds a member may take to answer one request
    ride_out: float = 0.0  # seconds every member may stay silent after an answer (module doc)

    @classmethod
    def from_conf(cls, endpoint: str, conf: dict, password: str = "") -> Settings:
        """``endpoint``: ``HOST:PORT[,HOST:PORT...]``; ``conf``: torch's rendezvous config
        keys (``protocol``, ``ca_cert``, ``ssl_cert``, ``ssl_cert_key``, ``user``,
        ``read_timeout``) and ``isolation_timeout``, as ``launch.config.rdzv_configs`` writes them."""
        endpoints = tuple(e.strip() for e in endpoint.split(",") if e.strip())
        if not endpoints:
            raise EtcdRefused("no etcd endpoint given: set rendezvous.endpoint to HOST:PORT[,HOST:PORT...]")
        return cls(endpoints=endpoints, protocol=str(conf.get("protocol", "http")).strip().lower(),
                   ca_cert=str(conf.get("ca_cert") or ""), cert=str(conf.get("ssl_cert") or ""),
                   key=str(conf.get("ssl_cert_key") or ""), user=str(conf.get("user") or ""),
                   password=password, timeout=float(conf.get("read_timeout") or 10),
                   ride_out=float(conf.get("isolation_timeout") or 0))


def split_host_port(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, _, port = endpoint.strip().rpartition(":")
    return host.strip("[]"), int(port)


def tls_context(settings: Settings) -> ssl.SSLContext:
    """The client's TLS context; a file that cannot be loaded is ``EtcdRefused`` naming it."""
    try:
        context = ssl.create_default_context(cafile=settings.ca_cert or None)
    except (OSError, ssl.SSLError) as e:
        raise EtcdRefused(f"cannot load rendezvous.etcd_ca_cert '{settings.ca_cert}': {e}") from None
    if settings.cert:
        try:
            context.load_cert_chain(settings.cert, settings.key or None)
        except (OSError, ssl.SSLError) as e:
            raise EtcdRefused(f"cannot load rendezvous.etcd_cert '{settings.cert}' / etcd_key "
                              f"'{settings.key}': {e}") from None
    return context


class _Unreachable(Exception):
    """This member cannot answer now: try the next one. ``answered``: it said so itself
    (a 5xx, etcd's "unavailable"), so the cluster is there and may serve again in moments."""

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class Gateway:
    """A client of one etcd cluster's v3 JSON gateway (module doc). Thread-safe: each thread
    keeps its own connections."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        self._clock, self._sleep = clock, sleep
        self._tls = tls_context(settings) if settings.protocol == "https" else None
        self._local = threading.local()
        self._current = 0  # the member that answered last
        self._tokens: dict[str, str] = {}  # member -> auth token it issued
        self.endpoints = list(settings.endpoints)  # the members it may ask (``learn_members``)
        self._answered_at: float | None = None  # when a member last answered (``ride_out``)

    def call(self, path: str, body: dict) -> dict:
        """POST ``/v3/<path>`` with ``body``; the reply's JSON (module doc: members, errors)."""
        deadline = self._clock() + self.settings.timeout
        while True:
            reply, failures, answered = self._one_pass(path, body)
            if reply is not None:
                self._answered_at = self._clock()
                return reply
            pause = UNAVAILABLE_PAUSE_S if answered else self._silence_pause()
            if pause is None or (answered and self._clock() + pause > deadline):
                raise EtcdUnavailable("no etcd member answered (" + "; ".join(failures) + ")")
            self._sleep(pause)  # an election, a quorum or a restarted member coming back: ask again

    def _silence_pause(self) -> float | None:
        """No member answered: the pause before asking again while riding it out, or None
        (never answered before, or silent ``ride_out`` seconds since the last answer)."""
        if self._answered_at is None:
            return None
        left = self._answered_at + self.settings.ride_out - self._clock()
        return min(RIDE_OUT_PAUSE_S, left) if left > 0 else None

    def _one_pass(self, path: str, body: dict) -> tuple[dict | None, list[str], bool]:
        """Each member once, the one that answered last first: (reply or None, each failure,
        whether any member answered that it is unavailable for now)."""
        endpoints = list(self.endpoints)
        failures, answered = [], False
        for i in range(len(endpoints)):
            index = (self._current + i) % len(endpoints)
            try:
                reply = self._call_member(endpoints[index], path, body)
            except _Unreachable as e:
                failures.append(f"{endpoints[index]}: {e}")
                answered = answered or e.answered
                continue
            self._current = index
            return reply, failures, answered
        return None, failures, answered

    def members(self) -> list[str]:
        """``HOST:PORT`` of every client URL the cluster's members advertise."""
        out = []
        for member in self.call("cluster/member/list", {}).get("members", []):
            for url in member.get("clientURLs", []):
                parts = urlsplit(url)
                if parts.hostname and parts.port:
                    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
                    out.append(f"{host}:{parts.port}")
        return out

    def learn_members(self) -> None:
        """Add the members the cluster advertises to those it may ask (after the ones the
        job named), as python-etcd does for torch's etcd-v2 backend: naming one member then
        suffices to survive losing it. Best effort: a failure keeps the list as it is."""
        try:
            found = self.members()
        except EtcdError:
            return
        self.endpoints = list(dict.fromkeys([*self.endpoints, *found]))

    def watch(self, key: bytes, start_revision: int) -> Watch:
        """Watch ``key`` from ``start_revision`` on the first member that takes it (the one
        that answered last first); ``EtcdUnavailable`` when none does."""
        body = {"create_request": {"key": b64(key), "start_revision": str(start_revision)}}
        failures = []
        for i in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._current + i) % len(self.endpoints)]
            try:
                return self._open_watch(endpoint, body)
            except _Unreachable as e:
                failures.append(f"{endpoint}: {e}")
        raise EtcdUnavailable("no etcd member took the watch (" + "; ".join(failures) + ")")

    def _open_watch(self, endpoint: str, body: dict) -> Watch:
        if self.settings.user and endpoint not in self._tokens:
            self._tokens[endpoint] = self._authenticate(endpoint)
        conn = self._open(endpoint)
        headers = {"Content-Type": "application/json"}
        if self._tokens.get(endpoint):
            headers["Authorization"] = self._tokens[endpoint]
        try:
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise _Unreachable(str(e) or type(e).__name__) from None
        if response.status != 200:
            reply = _parse(response.read())
            conn.close()
            self._judge(endpoint, response.status, reply)
            raise _Unreachable(f"HTTP {response.status}")
        conn.sock.settimeout(None)  # a watch waits as long as nothing changes
        return Watch(conn, response)

    def close(self) -> None:
        """Close this thread's connections."""
        for conn in getattr(self._local, "conns", {}).values():
            conn.close()
        self._local.conns = {}

    def _call_member(self, endpoint: str, path: str, body: dict) -> dict:
        user = self.settings.user
        if user and endpoint not in self._tokens:
            self._tokens[endpoint] = self._authenticate(endpoint)
        status, reply = self._post(endpoint, path, body, self._tokens.get(endpoint))
        if user and reply.get("code") == 16:  # the token expired, or another member issued it
            self._tokens[endpoint] = self._authenticate(endpoint)
            status, reply = self._post(endpoint, path, body, self._tokens[endpoint])
        return self._judge(endpoint, status, reply)

    def _authenticate(self, endpoint: str) -> str:
        s = self.settings
        status, reply = self._post(endpoint, "auth/authenticate", {"name": s.user, "password": s.password}, None)
        message = str(reply.get("message", ""))
        if "authentication is not enabled" in message:
            raise EtcdRefused(f"the etcd at {endpoint} has authentication off, but the job gives "
                              f"rendezvous.etcd_user '{s.user}': turn it on there (etcdctl auth enable) "
                              "or remove etcd_user and etcd_password_file")
        if "authentication failed" in message:
            raise EtcdRefused(f"the etcd at {endpoint} refused user '{s.user}' with the password in "
                              "rendezvous.etcd_password_file (invalid user or password): fix either")
        return str(self._judge(endpoint, status, reply)["token"])

    def _judge(self, endpoint: str, status: int, reply: dict) -> dict:
        """Pure but for its message: an answer -> the reply, or the error it means."""
        if status == 200:
            return reply
        code, message = reply.get("code"), str(reply.get("message") or reply.get("_text", ""))[:200]
        if status >= 500 or code in (4, 14):  # etcd unavailable, timed out, no leader
            raise _Unreachable(f"HTTP {status}: {message}", answered=True)
        refusal = refusal_for(endpoint, status, code, message, self.settings)
        if refusal:
            raise EtcdRefused(refusal)
        raise EtcdError(f"etcd at {endpoint} answered HTTP {status}: {message}", code or 0)

    def _post(self, endpoint: str, path: str, body: dict, token: str | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        data = json.dumps(body).encode()
        hung_up = 0  # fresh TLS connections closed on the first request
        for attempt in range(3):  # a kept-alive connection the member closed: again, fresh
            conn, fresh = self._connection(endpoint)
            try:
                conn.request("POST", f"/v3/{path}", data, headers)
                response = conn.getresponse()
                return response.status, _parse(response.read())
            except ssl.SSLError as e:
                conn.close()
                if not isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                    raise EtcdRefused(tls_refusal(endpoint, e, self.settings)) from None
                # TLS 1.3: a server that rejects the client's certificate (or its absence)
                # says so after the handshake, often by hanging up: twice on fresh connections
                hung_up += fresh
                if hung_up == 2:
                    raise EtcdRefused(tls_refusal(endpoint, ssl.SSLError("certificate rejected: the "
                                                  "server closed the connection"), self.settings)) from None
                if attempt == 2:
                    raise _Unreachable(f"TLS connection closed: {e}") from None
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                if fresh and self._tls is None and speaks_tls(*split_host_port(endpoint)):
                    raise EtcdRefused(refusal_for(endpoint, 400, None, "HTTPS", self.settings)) from None
                if fresh or attempt:  # not a stale kept-alive connection: the member is gone
                    raise _Unreachable(str(e) or type(e).__name__) from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise _Unreachable(str(e) or type(e).__name__) from None
        raise AssertionError("unreachable")

    def _connection(self, endpoint: str) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``endpoint``, and whether it is new."""
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(endpoint)
        if conn is not None and conn.sock is not None:
            return conn, False
        conns[endpoint] = conn = self._open(endpoint)
        return conn, True

    def _open(self, endpoint: str) -> http.client.HTTPConnection:
        """A new connection to ``endpoint``, connected (errors: ``_connection``'s)."""
        host, port = split_host_port(endpoint)
        if self._tls is not None:
            conn = http.client.HTTPSConnection(host, port, timeout=CONNECT_TIMEOUT_S, context=self._tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
        try:
            conn.connect()
        except ssl.SSLError as e:
            conn.close()
            if not isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                raise EtcdRefused(tls_refusal(endpoint, e, self.settings)) from None
            if speaks_plain_http(host, port):  # it hung up on the handshake: not TLS there
                raise EtcdRefused(tls_refusal(endpoint, ssl.SSLError("wrong version number"),
                                              self.settings)) from None
            raise _Unreachable(f"TLS connection closed: {e}") from None
        except OSError as e:
            conn.close()
            # a plain-http server may reset the connection on a ClientHello rather than close it
            if self._tls is not None and isinstance(e, ConnectionResetError) and speaks_plain_http(host, port):
                raise EtcdRefused(tls_refusal(endpoint, ssl.SSLError("wrong version number"),
                                              self.settings)) from None
            raise _Unreachable(str(e) or type(e).__name__) from None
        conn.sock.settimeout(self.settings.timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


class Watch:
    """One key watched through the gateway's ``/v3/watch`` stream (``Gateway.watch``).

    ``revisions()`` yields the mod revision of each put of the key, from the revision the
    watch started at, until the stream ends (the member went away, ``close``); a delete is
    not yielded. The stream's connection is its own, with no read timeout: a watch waits
    for as long as nothing changes. ``close`` (from any thread) shuts its socket, which ends
    a blocked ``revisions()``."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self._conn, self._response = conn, response
        self._closed = False

    def revisions(self) -> Iterator[int]:
        try:
            while not self._closed:
                try:
                    line = self._response.readline()
                    result = json.loads(line).get("result") or {} if line else None
                except (OSError, ValueError, AttributeError, http.client.HTTPException):
                    return  # the stream ended or was shut (``close``)
                if result is None or result.get("canceled"):
                    return
                for event in result.get("events") or []:
                    if event.get("type", "PUT") == "PUT":
                        yield int(event["kv"]["mod_revision"])
        finally:
            self._conn.close()

    def close(self) -> None:
        """End the stream: its socket is shut here, and closed by the reader on its way out."""
        self._closed = True
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def speaks_tls(host: str, port: int) -> bool:
    """Does the server at ``host:port`` answer a TLS handshake (certificates not checked)?
    Asked only after it hung up on a plain-http request, to tell why."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            return True
    except ssl.SSLError as e:  # an alert (it wants a client certificate) is TLS talking
        return not isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError))
    except OSError:
        return False


def speaks_plain_http(host: str, port: int) -> bool:
    """Does the server at ``host:port`` answer a plain-http request? Asked only after it hung
    up on a TLS handshake, to tell why."""
    conn = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
    try:
        conn.request("GET", "/version")
        return conn.getresponse().status > 0
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _parse(raw: bytes) -> dict:
    """A reply's JSON; a body that is not JSON (a 404 page, a proxy's text) as ``_text``."""
    try:
        reply = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"_text": raw.decode(errors="replace").strip()}
    return reply if isinstance(reply, dict) else {"_text": str(reply)}


def refusal_for(endpoint: str, status: int, code: object, message: str, s: Settings) -> str:
    """Pure: the one line for an answer that says the job's settings are wrong, else ''."""
    if status == 404 and code is None:
        return (f"the server at {endpoint} has no etcd v3 API (HTTP 404 on /v3/: an etcd older than "
                "3.4, one serving only the v2 API, or not etcd): point rendezvous.endpoint at etcd 3.4 "
                "or newer, or use rendezvous.backend: etcd-v2 for an etcd with only --enable-v2")
    if status == 400 and code is None and "HTTPS" in message:
        return (f"the etcd at {endpoint} speaks https, but rendezvous.etcd_protocol is http: set "
                "etcd_protocol: https (with etcd_ca_cert, and etcd_cert/etcd_key if it asks for "
                "client certificates)")
    if "user name is empty" in message or (code == 16 and not s.user):
        return (f"the etcd at {endpoint} requires authentication: set rendezvous.etcd_user and "
                "etcd_password_file (a file holding the password)")
    if code == 7:
        user = f"user '{s.user}'" if s.user else "this client"
        return (f"the etcd at {endpoint} denied {user} access to the rendezvous keys ({message}): grant "
                "it read and write on the prefix /torch/elastic/")
    return ""


def tls_refusal(endpoint: str, error: ssl.SSLError, s: Settings) -> str:
    """Pure: the one line for a TLS handshake that failed with ``error``."""
    text = str(error)
    if "WRONG_VERSION_NUMBER" in text.upper() or "wrong version number" in text:
        return (f"the etcd at {endpoint} does not speak TLS, but the job asks for it "
                "(rendezvous.etcd_protocol: https): serve etcd over https (--cert-file, --key-file, "
                "--client-cert-auth), or set etcd_protocol: http where no TLS is wanted")
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"the certificate of the etcd at {endpoint} is not trusted ({error.verify_message}): set "
                "rendezvous.etcd_ca_cert to the CA that signed it, with the address in its names")
    if "CERTIFICATE" in text.upper():
        have = "its certificate" if s.cert else "no client certificate"
        return (f"the etcd at {endpoint} refused the TLS handshake with {have} ({text[:120]}): set "
                "rendezvous.etcd_cert and etcd_key to a certificate signed by etcd's --trusted-ca-file")
    return f"TLS with the etcd at {endpoint} failed ({text[:160]}): check the rendezvous.etcd_* settings"

