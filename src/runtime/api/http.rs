//! The HTTP control endpoint: a small HTTP/1.1 server on tokio over a `ControlHandle`.
//!
//! | request | answer |
//! |---|---|
//! | `GET /status` | 200, the `Status` document as JSON |
//! | `GET /metrics` | 200, Prometheus text format |
//! | `POST /ranks/{id}/drain` | 202: the rank leaves at the next step boundary |
//! | `POST /ranks/{id}/kill` | 202: the rank vanishes in the next step (403 unless allowed) |
//! | `POST /join?count=N` | 202: N ranks join at the next step boundary (N defaults to 1; with worker processes 409 `no_standby` unless N standby workers are connected) |
//! | `POST /checkpoint` | 202: a checkpoint at the next step boundary (409 without a save dir) |
//!
//! Errors are JSON `{"error": CODE, "message": TEXT}` with a 4xx/5xx status, and change nothing.
//!
//! Mutating requests (drain, kill, join, checkpoint) need the operator token
//! (`Authorization: Bearer TOKEN`, see [`Access`]) whenever one is set, and always when the
//! endpoint listens beyond loopback: there, without a token, they are refused (401). Reads
//! stay open unless [`AuthScope::All`]. A refused attempt is logged with its address.
//! One request per connection (`Connection: close`). Everything is bounded: the head and body
//! sizes, the time to read a request, and the number of open connections (more are closed at
//! once). Parsing and routing are pure functions, tested without sockets.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::{timeout, timeout_at, Instant};

use super::control::{ControlError, ControlHandle};
use crate::plan::RankId;

/// Bounds of the server. Defaults: 8 KiB head, 4 KiB body, 5 s to read a request, 32 open
/// connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    pub max_head_bytes: usize,
    pub max_body_bytes: usize,
    pub read_timeout_ms: u64,
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_head_bytes: 8 << 10,
            max_body_bytes: 4 << 10,
            read_timeout_ms: 5_000,
            max_connections: 32,
        }
    }
}

/// A parsed request head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_length: usize,
    /// The `Authorization` header's value, if sent.
    pub authorization: Option<String>,
}

/// Which requests need the operator token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AuthScope {
    /// Drain, kill, join and checkpoint; `GET /status` and `/metrics` stay open (scrapers).
    #[default]
    Writes,
    /// Every request.
    All,
}

/// Who may do what on the endpoint.
#[derive(Clone, Default)]
pub struct Access {
    /// The operator token requests in `scope` must carry as `Authorization: Bearer TOKEN`.
    pub token: Option<String>,
    pub scope: AuthScope,
    /// The endpoint listens beyond loopback: without a token, requests in `scope` are refused.
    pub beyond_loopback: bool,
    /// Serve HTTPS with this config (the coordinator's cluster certificate; clients check it
    /// against the cluster CA) instead of plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl PartialEq for Access {
    fn eq(&self, other: &Self) -> bool {
        self.token == other.token
            && self.scope == other.scope
            && self.beyond_loopback == other.beyond_loopback
            && self.tls.is_some() == other.tls.is_some()
    }
}

impl Eq for Access {}

impl std::fmt::Debug for Access {
    // Never print the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("scope", &self.scope)
            .field("beyond_loopback", &self.beyond_loopback)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Access {
    /// The access rules of an endpoint listening on `addr`.
    pub fn new(addr: SocketAddr, token: Option<String>, scope: AuthScope) -> Self {
        Self {
            token,
            scope,
            beyond_loopback: !addr.ip().is_loopback(),
            tls: None,
        }
    }

    /// Whether `route` may go ahead with this request's `Authorization` header; the refusal
    /// (401) otherwise.
    /// The live page (`GET /`) is served to anyone who reaches the endpoint: it holds no data
    /// of the run, and its reads of `/history` carry the token when the scope asks for one.
    pub fn check(&self, route: Route, authorization: Option<&str>) -> Result<(), Response> {
        if route == Route::Page {
            return Ok(());
        }
        let in_scope = self.scope == AuthScope::All || route.mutates();
        if !in_scope || (self.token.is_none() && !self.beyond_loopback) {
            return Ok(());
        }
        let unauthorized = |message: &str| {
            let mut r = Response::error(401, "unauthorized", message);
            r.challenge = true;
            Err(r)
        };
        let Some(token) = &self.token else {
            return unauthorized("this endpoint listens beyond loopback and was started without an operator token, so it refuses changes: restart it with EZERO_CONTROL_TOKEN_FILE (or --control-token-file)");
        };
        let Some(header) = authorization else {
            return unauthorized("missing operator token: send `Authorization: Bearer TOKEN`");
        };
        let Some(given) = header
            .strip_prefix("Bearer ")
            .map(str::trim)
            .filter(|t| !t.is_empty())
        else {
            return unauthorized("malformed Authorization header: expected `Bearer TOKEN`");
        };
        if !same_secret(given.as_bytes(), token.as_bytes()) {
            return unauthorized("wrong operator token");
        }
        Ok(())
    }
}

/// Compares without an early exit on the first differing byte, so timing tells an attacker
/// nothing about how much of a guess was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    diff == 0
}

/// What `parse_head` made of the bytes so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parse {
    /// The head is not complete yet: read more.
    Incomplete,
    /// The head and its length in bytes (the body follows).
    Done(Request, usize),
}

/// An answer, ready to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
    /// For 405: the methods the path accepts.
    pub allow: Option<&'static str>,
    /// For 401: ask for a bearer token (`WWW-Authenticate`).
    pub challenge: bool,
}

impl Response {
    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: format!("{value}\n"),
            allow: None,
            challenge: false,
        }
    }

    pub fn error(status: u16, code: &str, message: impl Into<String>) -> Self {
        Self::json(status, &json!({ "error": code, "message": message.into() }))
    }

    fn from_control(e: &ControlError) -> Self {
        Self::error(e.http_status(), e.code(), e.to_string())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        if let Some(allow) = self.allow {
            head.push_str(&format!("Allow: {allow}\r\n"));
        }
        if self.challenge {
            head.push_str("WWW-Authenticate: Bearer realm=\"ezero\"\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(self.body.as_bytes());
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// Parses a request head from the bytes read so far.
pub fn parse_head(buf: &[u8], limits: &HttpLimits) -> Result<Parse, Response> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        if buf.len() > limits.max_head_bytes {
            return Err(too_large_head(limits));
        }
        return Ok(Parse::Incomplete);
    };
    if end + 4 > limits.max_head_bytes {
        return Err(too_large_head(limits));
    }
    let head = std::str::from_utf8(&buf[..end])
        .map_err(|_| Response::error(400, "bad_request", "the request head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Response::error(
            400,
            "bad_request",
            format!("malformed request line `{line}`"),
        ));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(Response::error(
            505,
            "bad_version",
            format!("{version} is not supported: use HTTP/1.1"),
        ));
    }
    let mut content_length = 0usize;
    let mut authorization = None;
    for h in lines {
        let (name, value) = h.split_once(':').ok_or_else(|| {
            Response::error(400, "bad_request", format!("malformed header `{h}`"))
        })?;
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            content_length = value.parse().map_err(|_| {
                Response::error(400, "bad_request", format!("bad Content-Length `{value}`"))
            })?;
        } else if name.eq_ignore_ascii_case("authorization") {
            authorization = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Response::error(
                501,
                "not_implemented",
                "chunked bodies are not supported; no request needs a body",
            ));
        }
    }
    if content_length > limits.max_body_bytes {
        return Err(Response::error(
            413,
            "body_too_large",
            format!(
                "bodies are limited to {} bytes (no request needs one)",
                limits.max_body_bytes
            ),
        ));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    Ok(Parse::Done(
        Request {
            method: method.to_string(),
            path: path.to_string(),
            query: query.to_string(),
            content_length,
            authorization,
        },
        end + 4,
    ))
}

fn too_large_head(limits: &HttpLimits) -> Response {
    Response::error(
        431,
        "head_too_large",
        format!(
            "request heads are limited to {} bytes",
            limits.max_head_bytes
        ),
    )
}

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Status,
    Metrics,
    /// The run's recent steps and events as JSON (`history::History`).
    History,
    /// The live page that draws `/history`.
    Page,
    Drain(RankId),
    Kill(RankId),
    Join(u32),
    Checkpoint,
}

impl Route {
    /// Whether the request changes the job (and so needs the operator token, see [`Access`]).
    pub fn mutates(self) -> bool {
        !matches!(
            self,
            Route::Status | Route::Metrics | Route::History | Route::Page
        )
    }
}

/// Maps a request to a route, or to the error answer (404, 405, 400).
pub fn route(req: &Request) -> Result<Route, Response> {
    let segments: Vec<&str> = req.path.trim_end_matches('/').split('/').skip(1).collect();
    let (route, allow) = match segments.as_slice() {
        [] => (Route::Page, "GET"),
        ["status"] => (Route::Status, "GET"),
        ["history"] => (Route::History, "GET"),
        ["metrics"] => (Route::Metrics, "GET"),
        ["checkpoint"] => (Route::Checkpoint, "POST"),
        ["join"] => (Route::Join(join_count(&req.query)?), "POST"),
        ["ranks", id, action @ ("drain" | "kill")] => {
            let rank: RankId = id.parse().map_err(|_| {
                Response::error(400, "bad_rank", format!("`{id}` is not a rank id (a non-negative integer)"))
            })?;
            let route = if *action == "drain" { Route::Drain(rank) } else { Route::Kill(rank) };
            (route, "POST")
        }
        _ => {
            return Err(Response::error(
                404,
                "not_found",
                format!("no endpoint {}: use GET / (the live page), GET /status, GET /metrics, GET /history, POST /ranks/{{id}}/drain, POST /ranks/{{id}}/kill, POST /join?count=N, POST /checkpoint", req.path),
            ))
        }
    };
    if req.method != allow {
        let mut r = Response::error(
            405,
            "method_not_allowed",
            format!("{} takes {allow}", req.path),
        );
        r.allow = Some(allow);
        return Err(r);
    }
    Ok(route)
}

fn join_count(query: &str) -> Result<u32, Response> {
    let bad = |what: String| Response::error(400, "bad_count", what);
    let mut count = 1;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("count", v)) => {
                count =
                    v.parse().ok().filter(|&n: &u32| n >= 1).ok_or_else(|| {
                        bad(format!("count `{v}` must be an integer of at least 1"))
                    })?
            }
            _ => {
                return Err(bad(format!(
                    "unknown query parameter `{pair}`: only count=N"
                )))
            }
        }
    }
    Ok(count)
}

/// Carries out a route over the handle.
pub async fn dispatch(route: Route, handle: &ControlHandle) -> Response {
    let accepted = |what: serde_json::Value| Response::json(202, &what);
    let res = match route {
        Route::Status => handle.status().await.map(|s| {
            Response::json(
                200,
                &serde_json::to_value(s).unwrap_or_else(|e| json!({"error": e.to_string()})),
            )
        }),
        Route::Metrics => handle.metrics().await.map(|text| Response {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body: text,
            allow: None,
            challenge: false,
        }),
        Route::History => Ok(Response::json(
            200,
            &serde_json::to_value(handle.history())
                .unwrap_or_else(|e| json!({"error": e.to_string()})),
        )),
        Route::Page => Ok(Response {
            status: 200,
            content_type: "text/html; charset=utf-8",
            body: super::page::PAGE.to_string(),
            allow: None,
            challenge: false,
        }),
        Route::Drain(rank) => handle.drain(rank).await.map(|_| {
            accepted(json!({"accepted": "drain", "rank": rank, "when": "next step boundary"}))
        }),
        Route::Kill(rank) => handle.kill(rank).await.map(|_| {
            accepted(json!({"accepted": "kill", "rank": rank, "when": "during the next step"}))
        }),
        Route::Join(count) => handle.join(count).await.map(|_| {
            accepted(json!({"accepted": "join", "count": count, "when": "next step boundary"}))
        }),
        Route::Checkpoint => handle
            .request_snapshot()
            .await
            .map(|_| accepted(json!({"accepted": "checkpoint", "when": "next step boundary"}))),
    };
    res.unwrap_or_else(|e| Response::from_control(&e))
}

/// Binds `addr` and serves until the returned task is aborted.
pub async fn serve(
    addr: SocketAddr,
    handle: ControlHandle,
    limits: HttpLimits,
    access: Access,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((local, serve_on(listener, handle, limits, access)))
}

/// Serves on a bound listener until the returned task is aborted (a caller that must print
/// the address before the job exists binds first; requests wait in the backlog until then).
pub fn serve_on(
    listener: TcpListener,
    handle: ControlHandle,
    limits: HttpLimits,
    access: Access,
) -> JoinHandle<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let access = Arc::new(access);
    tokio::spawn(async move {
        loop {
            let (sock, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                // Out of descriptors or a connection reset before accept: back off, go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
                // Over the limit: answer without waiting and close.
                let busy = Response::error(503, "busy", "too many open control connections");
                let _ = sock.try_write(&busy.to_bytes());
                continue;
            };
            let (handle, access) = (handle.clone(), Arc::clone(&access));
            tokio::spawn(async move {
                if let Some(io) = open(sock, access.tls.as_ref(), &limits).await {
                    connection(io, peer, &handle, &limits, &access).await;
                }
                drop(permit);
            });
        }
    })
}

/// Answers every request on `listener` with 503 `not_started` and `why()` until `ready`
/// fires (or its sender goes), then hands the listener back for `serve_on`: a process
/// coordinator's endpoint exists before the job it controls.
pub async fn hold(
    listener: TcpListener,
    limits: HttpLimits,
    tls: Option<Arc<rustls::ServerConfig>>,
    why: impl Fn() -> Holding + Send + 'static,
    mut ready: tokio::sync::oneshot::Receiver<()>,
) -> TcpListener {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let sock = tokio::select! {
            _ = &mut ready => return listener,
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => sock,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        let holding = why();
        let tls = tls.clone();
        tokio::spawn(async move {
            if let Some(io) = open(sock, tls.as_ref(), &limits).await {
                respond(io, &limits, |req| async move { holding.answer(&req) }).await;
            }
            drop(permit);
        });
    }
}

/// Why an endpoint held by [`hold`] serves no job yet.
#[derive(Clone, Debug)]
pub enum Holding {
    /// The job has not started (the message says what it waits for): 503 to everything.
    NotStarted(String),
    /// A standby coordinator: `GET /status` answers 200 with `status` (who leads, where), and
    /// everything else 503 with `note`, since only the leader acts on the job.
    StandingBy {
        note: String,
        status: serde_json::Value,
    },
}

impl Holding {
    fn answer(&self, req: &Request) -> Response {
        match self {
            Holding::NotStarted(why) => Response::error(503, "not_started", why.clone()),
            Holding::StandingBy { status, .. } if req.method == "GET" && req.path == "/status" => {
                Response::json(200, status)
            }
            Holding::StandingBy { note, .. } => Response::error(503, "standby", note.clone()),
        }
    }
}

/// A connection's byte stream: plain TCP, or TLS over it.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The accepted socket as the endpoint speaks it: through the TLS handshake when `tls` is set
/// (bounded by the read timeout; a failed handshake closes the connection).
async fn open(
    sock: TcpStream,
    tls: Option<&Arc<rustls::ServerConfig>>,
    limits: &HttpLimits,
) -> Option<Box<dyn Io>> {
    let Some(cfg) = tls else {
        return Some(Box::new(sock));
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(cfg));
    let wait = Duration::from_millis(limits.read_timeout_ms);
    match timeout(wait, acceptor.accept(sock)).await {
        Ok(Ok(stream)) => Some(Box::new(stream)),
        Ok(Err(e)) => {
            tracing::debug!("control endpoint: TLS handshake failed: {e}");
            None
        }
        Err(_) => None,
    }
}

async fn connection(
    sock: Box<dyn Io>,
    peer: SocketAddr,
    handle: &ControlHandle,
    limits: &HttpLimits,
    access: &Access,
) {
    respond(sock, limits, |req: Request| async move {
        let route = match route(&req) {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        if let Err(refused) = access.check(route, req.authorization.as_deref()) {
            tracing::warn!(
                "control endpoint: refused {} {} from {peer}: {}",
                req.method,
                req.path,
                refused.body.trim()
            );
            return refused;
        }
        dispatch(route, handle).await
    })
    .await
}

/// Reads one request, answers it with `answer`'s response (or the reading error), and closes.
async fn respond<F, Fut>(mut sock: Box<dyn Io>, limits: &HttpLimits, answer: F)
where
    F: FnOnce(Request) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    let deadline = Instant::now() + Duration::from_millis(limits.read_timeout_ms);
    let response = match read_request(&mut sock, limits, deadline).await {
        Ok(Some(req)) => answer(req).await,
        Ok(None) => return,
        Err(resp) => resp,
    };
    let write = async {
        sock.write_all(&response.to_bytes()).await?;
        sock.shutdown().await
    };
    let _ = timeout(Duration::from_millis(limits.read_timeout_ms), write).await;
}

/// Reads one request (head and body, which is discarded) before `deadline`. `Ok(None)`: the
/// peer closed before sending anything.
async fn read_request(
    sock: &mut Box<dyn Io>,
    limits: &HttpLimits,
    deadline: Instant,
) -> Result<Option<Request>, Response> {
    let timed_out = || {
        Response::error(
            408,
            "timeout",
            format!(
                "the request did not arrive within {} ms",
                limits.read_timeout_ms
            ),
        )
    };
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    let (req, head_len) = loop {
        if let Parse::Done(req, len) = parse_head(&buf, limits)? {
            break (req, len);
        }
        match timeout_at(deadline, sock.read(&mut chunk)).await {
            Err(_) => return Err(timed_out()),
            Ok(Ok(0)) if buf.is_empty() => return Ok(None),
            Ok(Ok(0)) | Ok(Err(_)) => {
                return Err(Response::error(
                    400,
                    "bad_request",
                    "the connection closed mid-request",
                ))
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let mut body_left = req.content_length.saturating_sub(buf.len() - head_len);
    while body_left > 0 {
        match timeout_at(deadline, sock.read(&mut chunk)).await {
            Err(_) => return Err(timed_out()),
            Ok(Ok(0)) | Ok(Err(_)) => {
                return Err(Response::error(
                    400,
                    "bad_request",
                    "the connection closed mid-body",
                ))
            }
            Ok(Ok(n)) => body_left = body_left.saturating_sub(n),
        }
    }
    Ok(Some(req))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Parse, Response> {
        parse_head(text.as_bytes(), &HttpLimits::default())
    }

    fn req(method: &str, target: &str) -> Request {
        match parse(&format!("{method} {target} HTTP/1.1\r\nHost: x\r\n\r\n")) {
            Ok(Parse::Done(r, _)) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn heads_parse_when_complete_and_not_before() {
        assert_eq!(
            parse("GET /status HTTP/1.1\r\nHost: x\r\n"),
            Ok(Parse::Incomplete)
        );
        let text = "POST /join?count=2 HTTP/1.1\r\ncontent-length: 3\r\n\r\nabc";
        let Ok(Parse::Done(r, len)) = parse(text) else {
            panic!()
        };
        assert_eq!(len, text.len() - 3);
        assert_eq!(
            r,
            Request {
                method: "POST".into(),
                path: "/join".into(),
                query: "count=2".into(),
                content_length: 3,
                authorization: None,
            }
        );
    }

    #[test]
    fn bad_heads_get_clear_errors() {
        let status = |t: &str| parse(t).unwrap_err().status;
        assert_eq!(status("GET /status\r\n\r\n"), 400);
        assert_eq!(status("GET /status HTTP/2\r\n\r\n"), 505);
        assert_eq!(status("GET / HTTP/1.1\r\nno colon\r\n\r\n"), 400);
        assert_eq!(status("GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"), 400);
        assert_eq!(
            status("GET / HTTP/1.1\r\nContent-Length: 99999\r\n\r\n"),
            413
        );
        assert_eq!(
            status("GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            501
        );
        let limits = HttpLimits {
            max_head_bytes: 16,
            ..HttpLimits::default()
        };
        let long = "GET /status HTTP/1.1\r\nHost: a-long-host-name";
        assert_eq!(
            parse_head(long.as_bytes(), &limits).unwrap_err().status,
            431
        );
    }

    #[test]
    fn routes_map_paths_methods_and_ids() {
        assert_eq!(route(&req("GET", "/status")), Ok(Route::Status));
        assert_eq!(route(&req("GET", "/metrics/")), Ok(Route::Metrics));
        assert_eq!(route(&req("GET", "/")), Ok(Route::Page));
        assert_eq!(route(&req("GET", "/history")), Ok(Route::History));
        assert_eq!(route(&req("POST", "/ranks/3/drain")), Ok(Route::Drain(3)));
        assert_eq!(route(&req("POST", "/ranks/0/kill")), Ok(Route::Kill(0)));
        assert_eq!(route(&req("POST", "/join")), Ok(Route::Join(1)));
        assert_eq!(route(&req("POST", "/join?count=3")), Ok(Route::Join(3)));
        assert_eq!(route(&req("POST", "/checkpoint")), Ok(Route::Checkpoint));
        let err = |m: &str, t: &str| route(&req(m, t)).unwrap_err();
        assert_eq!(err("GET", "/nope").status, 404);
        assert_eq!(err("POST", "/ranks/3/explode").status, 404);
        assert_eq!(err("POST", "/ranks/x/drain").status, 400);
        assert_eq!(err("POST", "/ranks/-1/drain").status, 400);
        assert_eq!(err("POST", "/join?count=0").status, 400);
        assert_eq!(err("POST", "/join?n=2").status, 400);
        let wrong = err("GET", "/ranks/1/drain");
        assert_eq!((wrong.status, wrong.allow), (405, Some("POST")));
        assert_eq!(err("POST", "/status").status, 405);
    }

    #[test]
    fn beyond_loopback_changes_need_the_operator_token() {
        let wide: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let token = Some("s3cret".to_string());
        let guarded = Access::new(wide, token.clone(), AuthScope::Writes);
        let drain = Route::Drain(1);
        for header in [
            None,
            Some("Bearer nope"),
            Some("s3cret"),
            Some("Bearer "),
            Some("Basic s3cret"),
        ] {
            let refused = guarded.check(drain, header).unwrap_err();
            assert_eq!(
                (refused.status, refused.challenge),
                (401, true),
                "{header:?}"
            );
            let text = String::from_utf8(refused.to_bytes()).unwrap();
            assert!(text.contains("WWW-Authenticate: Bearer"), "{text}");
        }
        assert!(guarded.check(drain, Some("Bearer s3cret")).is_ok());
        assert!(guarded.check(Route::Status, None).is_ok());
        assert!(guarded.check(Route::Metrics, None).is_ok());
        // Beyond loopback without a token: changes are refused, reads are not.
        let open_wide = Access::new(wide, None, AuthScope::Writes);
        assert_eq!(
            open_wide
                .check(Route::Checkpoint, Some("Bearer x"))
                .unwrap_err()
                .status,
            401
        );
        assert!(open_wide.check(Route::Status, None).is_ok());
        // Loopback: open without a token, guarded with one.
        assert!(Access::new(local, None, AuthScope::Writes)
            .check(drain, None)
            .is_ok());
        let local_token = Access::new(local, token.clone(), AuthScope::Writes);
        assert_eq!(
            local_token.check(Route::Kill(0), None).unwrap_err().status,
            401
        );
        // `all`: reads too.
        let all = Access::new(wide, token, AuthScope::All);
        assert_eq!(all.check(Route::Status, None).unwrap_err().status, 401);
        assert!(all.check(Route::Metrics, Some("Bearer s3cret")).is_ok());
        // The page holds no data and is served to all; its history read needs the token.
        assert!(all.check(Route::Page, None).is_ok());
        assert_eq!(all.check(Route::History, None).unwrap_err().status, 401);
        assert!(all.check(Route::History, Some("Bearer s3cret")).is_ok());
        assert!(!format!("{all:?}").contains("s3cret"));
    }

    #[test]
    fn the_authorization_header_is_read_and_secrets_compare_whole() {
        let text = "POST /checkpoint HTTP/1.1\r\nauthorization:  Bearer abc \r\n\r\n";
        let Ok(Parse::Done(r, _)) = parse(text) else {
            panic!()
        };
        assert_eq!(r.authorization.as_deref(), Some("Bearer abc"));
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert!(!same_secret(b"", b"a"));
    }

    #[test]
    fn responses_carry_length_and_close() {
        let r = Response::error(409, "below_min_ranks", "no");
        let text = String::from_utf8(r.to_bytes()).unwrap();
        assert!(text.starts_with("HTTP/1.1 409 Conflict\r\n"));
        assert!(text.contains(&format!("Content-Length: {}\r\n", r.body.len())));
        assert!(text.contains("Connection: close\r\n"));
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["error"], "below_min_ranks");
    }
}
