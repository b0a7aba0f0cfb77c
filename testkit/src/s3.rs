//! A real S3-compatible server on loopback for the object-store tests: `s3s` over its
//! file-system backend (`s3s-fs`), with signature checks on, served by hyper on a thread of
//! its own. Chosen over `moto` (a Python server from a virtualenv) because it costs the suite
//! no download at test time and starts in about a millisecond; it implements the conditional
//! puts (`If-None-Match: *`, `If-Match`) a lease needs, made atomic here (see `Wire`).
//!
//! Beside a plain server it can play the network's part: a delay added to every request (the
//! round trip of a remote store), a count of requests and bytes served, and an outage (`stop`
//! closes the listener and every open connection; `restart` serves again on the same port).
//! Objects are files under [`S3Server::object_path`], so a test can corrupt or delete one.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

/// The access key the server accepts.
pub const ACCESS_KEY: &str = "pvisor-test-access";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "pvisor-test-secret-key-0123456789";
/// The region clients sign for.
pub const REGION: &str = "us-east-1";

/// What every request passes through: the delay, the counters, and the lock of conditional
/// puts.
#[derive(Debug, Default)]
struct Wire {
    delay_us: AtomicU64,
    requests: AtomicU64,
    bytes_out: AtomicU64,
    chunk_bytes_out: AtomicU64,
    /// Held while a conditional put (`If-None-Match`, `If-Match`) is served: `s3s-fs` checks
    /// the condition, then writes, so two racing creates could both succeed, where S3 lets
    /// one only. Served one at a time, they are atomic as S3's are.
    conditional: tokio::sync::Mutex<()>,
}

/// A running server; stopped on drop.
#[derive(Debug)]
pub struct S3Server {
    root: tempfile::TempDir,
    addr: SocketAddr,
    wire: Arc<Wire>,
    running: Option<Running>,
}

#[derive(Debug)]
struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    thread: JoinHandle<()>,
}

impl S3Server {
    /// Starts a server on a free loopback port with an empty root.
    pub fn start() -> Self {
        let root = tempfile::tempdir().expect("S3 server root");
        let listener = StdListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        let mut server = Self {
            root,
            addr,
            wire: Arc::default(),
            running: None,
        };
        server.serve(listener);
        server
    }

    /// `http://127.0.0.1:PORT`, for `--s3-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The environment a client needs besides the endpoint: credentials and region.
    pub fn env(&self) -> [(&'static str, &'static str); 3] {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", REGION),
        ]
    }

    /// Creates bucket `name` (a directory of the server's root).
    pub fn create_bucket(&self, name: &str) {
        std::fs::create_dir_all(self.root.path().join(name)).expect("create bucket");
    }

    /// The file that holds object `key` of `bucket`.
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        self.root.path().join(bucket).join(key)
    }

    /// The keys of `bucket` under `prefix`, sorted.
    pub fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let base = self.root.path().join(bucket);
        collect(&base, &base, &mut keys);
        keys.retain(|k| k.starts_with(prefix));
        keys.sort();
        keys
    }

    /// Adds `delay` to every request from now on (before it is served).
    pub fn set_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.wire.delay_us.store(us, Ordering::Relaxed);
    }

    /// Requests received so far.
    pub fn requests(&self) -> u64 {
        self.wire.requests.load(Ordering::Relaxed)
    }

    /// Body bytes of the responses sent so far (objects and ranges read, and the XML of
    /// listings and errors).
    pub fn bytes_out(&self) -> u64 {
        self.wire.bytes_out.load(Ordering::Relaxed)
    }

    /// The part of [`bytes_out`](Self::bytes_out) that was read from chunks of stores
    /// (objects named `seg-*`): guest memory, not indexes, manifests or disks.
    pub fn chunk_bytes_out(&self) -> u64 {
        self.wire.chunk_bytes_out.load(Ordering::Relaxed)
    }

    /// Takes the server down: the listener closes and every open connection is dropped.
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            let _ = running.stop.send(true);
            let _ = running.thread.join();
        }
    }

    /// Serves again on the same port after [`stop`](Self::stop).
    pub fn restart(&mut self) {
        self.stop();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match StdListener::bind(self.addr) {
                Ok(listener) => break listener,
                Err(e) if std::time::Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("rebind {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    fn serve(&mut self, listener: StdListener) {
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let fs = s3s_fs::FileSystem::new(self.root.path()).expect("s3s-fs root");
        let mut builder = S3ServiceBuilder::new(fs);
        builder.set_auth(SimpleAuth::from_single(ACCESS_KEY, SECRET_KEY));
        let service = builder.build();
        let wire = Arc::clone(&self.wire);
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("s3-test-server".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("server runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("tokio listener");
                    let mut connections = tokio::task::JoinSet::new();
                    loop {
                        let socket = tokio::select! {
                            accepted = listener.accept() => match accepted {
                                Ok((socket, _)) => {
                                    // As a real server does: small writes are not held back.
                                    let _ = socket.set_nodelay(true);
                                    socket
                                }
                                Err(_) => continue,
                            },
                            _ = stopped.changed() => break,
                        };
                        let service = service.clone();
                        let wire = Arc::clone(&wire);
                        let handler = hyper::service::service_fn(move |request| {
                            let service = service.clone();
                            let wire = Arc::clone(&wire);
                            async move {
                                wire.requests.fetch_add(1, Ordering::Relaxed);
                                let chunk = request.uri().path().contains("/seg-");
                                let delay = wire.delay_us.load(Ordering::Relaxed);
                                if delay > 0 {
                                    tokio::time::sleep(Duration::from_micros(delay)).await;
                                }
                                let conditional = request.method() == hyper::Method::PUT
                                    && (request.headers().contains_key("if-none-match")
                                        || request.headers().contains_key("if-match"));
                                let held = if conditional {
                                    Some(wire.conditional.lock().await)
                                } else {
                                    None
                                };
                                let response =
                                    hyper::service::Service::call(&service, request).await?;
                                drop(held);
                                let len = hyper::body::Body::size_hint(response.body())
                                    .exact()
                                    .or_else(|| {
                                        response
                                            .headers()
                                            .get("content-length")?
                                            .to_str()
                                            .ok()?
                                            .parse()
                                            .ok()
                                    })
                                    .unwrap_or(0);
                                wire.bytes_out.fetch_add(len, Ordering::Relaxed);
                                if chunk {
                                    wire.chunk_bytes_out.fetch_add(len, Ordering::Relaxed);
                                }
                                Ok::<_, s3s::HttpError>(response)
                            }
                        });
                        connections.spawn(async move {
                            let _ = ConnBuilder::new(TokioExecutor::new())
                                .serve_connection(TokioIo::new(socket), handler)
                                .await;
                        });
                    }
                    // Down means down: established connections go too.
                    connections.abort_all();
                    while connections.join_next().await.is_some() {}
                });
                runtime.shutdown_background();
            })
            .expect("spawn the S3 server thread");
        self.running = Some(Running { stop, thread });
    }

    /// The server's root directory (one directory per bucket).
    pub fn root(&self) -> &Path {
        self.root.path()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn collect(base: &Path, dir: &Path, keys: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(base, &path, keys);
        } else if let Ok(rel) = path.strip_prefix(base) {
            let key = rel.to_string_lossy().into_owned();
            // s3s-fs keeps its own metadata beside the objects.
            if !key.starts_with(".") && !key.contains("/.") {
                keys.push(key);
            }
        }
    }
}
