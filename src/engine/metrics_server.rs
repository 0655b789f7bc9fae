//! The metrics endpoint: with `RVOD_METRICS_PORT=P`, each rank answers `GET /metrics` at port P plus its
//! local rank with [`super::metrics::METRICS`] in Prometheus' text format. It listens on loopback, or, where
//! the job spans hosts, on the address its data connections use, so that a scraper on another host can
//! reach it. One listener per process, started by the first `init()` and kept across re-inits (an elastic
//! reset keeps its port); a port that cannot be bound is a warning, not a failed `init()`.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use super::metrics::METRICS;

/// Where this process serves metrics, once it does.
static SERVING: OnceLock<SocketAddr> = OnceLock::new();

/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Serve metrics at `ip`:`port` unless this process already does (then nothing changes). Returns where
/// metrics are served.
pub fn serve(ip: IpAddr, port: u16, rank: usize) -> Option<SocketAddr> {
    if let Some(addr) = SERVING.get() {
        return Some(*addr);
    }
    let listener = match TcpListener::bind((ip, port)) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::warn!(
                "rank {rank}: cannot serve metrics at {ip}:{port} (RVOD_METRICS_PORT plus the local rank): {e}"
            );
            return None;
        }
    };
    let addr = listener.local_addr().ok()?;
    let started = std::thread::Builder::new().name("rvod-metrics".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            answer(stream);
        }
    });
    if let Err(e) = started {
        tracing::warn!("rank {rank}: cannot start the metrics thread: {e}");
        return None;
    }
    tracing::info!("rank {rank}: serving Prometheus metrics at http://{addr}/metrics");
    Some(*SERVING.get_or_init(|| addr))
}

/// Answer one HTTP request: the metrics for `GET /metrics`, 404 for any other path, 405 for another method.
fn answer(mut stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(READ_TIMEOUT));
    let mut request = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => request.extend_from_slice(&chunk[..n]),
        }
    }
    let text = String::from_utf8_lossy(&request);
    let mut words = text.lines().next().unwrap_or_default().split_whitespace();
    let (method, path) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
    let (status, body) = match (method, path.split('?').next().unwrap_or_default()) {
        ("GET", "/metrics") => ("200 OK", METRICS.render()),
        ("GET", _) => ("404 Not Found", "rvod serves /metrics only\n".to_string()),
        _ => ("405 Method Not Allowed", "GET /metrics\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes()));
}
