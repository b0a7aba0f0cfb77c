//! A VM's side of the pool: attach (a read-only descriptor of the memfd), offer the hashes
//! of pages written since the last offer, merge the pages the pool holds with the same bytes,
//! and say which pool pages it stopped using.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use super::{errno, io, PoolError, Reply, Request};

/// A VM's connection to the pool.
#[derive(Debug)]
pub struct PoolClient {
    socket: PathBuf,
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    pool: File,
}

impl PoolClient {
    /// Attaches guest RAM at `ram_base` of `memory` bytes; gets the pool's memfd.
    pub fn attach(socket: &Path, ram_base: u64, memory: u64) -> Result<Self, PoolError> {
        let stream = UnixStream::connect(socket).map_err(io("connect to the pool daemon"))?;
        let text = serde_json::to_vec(&Request::Attach { ram_base, memory })
            .expect("a request serializes");
        let mut writer = &stream;
        writer
            .write_all(&text)
            .map_err(io("send to the pool daemon"))?;
        writer
            .write_all(b"\n")
            .map_err(io("send to the pool daemon"))?;
        // The reply line and the descriptor come in one message.
        let mut buf = vec![0u8; 64 << 10];
        // Close-on-exec from the start, and a daemon that sends more descriptors than the one
        // memfd gets them closed, not leaked into the VM.
        let received = crate::socket::recv_with_fds::<1>(&stream, &mut buf)
            .map_err(errno("read the pool daemon's reply"))?;
        if received.truncated {
            return Err(PoolError::Protocol(
                "the reply came with more than one descriptor".into(),
            ));
        }
        let reply: Reply = serde_json::from_slice(&buf[..received.bytes])
            .map_err(|e| PoolError::Protocol(format!("unreadable reply: {e}")))?;
        if let Some(error) = reply.error {
            return Err(PoolError::Protocol(error));
        }
        let mut fds = received.fds.into_iter();
        let pool = File::from(
            fds.next()
                .ok_or_else(|| PoolError::Protocol("no memfd in the reply".into()))?,
        );
        if fds.next().is_some() {
            return Err(PoolError::Protocol(
                "the reply came with more than one descriptor".into(),
            ));
        }
        let reader = BufReader::new(stream.try_clone().map_err(io("clone the socket"))?);
        Ok(Self {
            socket: socket.to_path_buf(),
            stream,
            reader,
            pool,
        })
    }

    /// The socket it is connected to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The pool's memfd (read-only).
    pub fn pool(&self) -> &File {
        &self.pool
    }

    fn call(&mut self, request: &Request) -> Result<Reply, PoolError> {
        let mut text = serde_json::to_vec(request).expect("a request serializes");
        text.push(b'\n');
        (&self.stream)
            .write_all(&text)
            .map_err(io("send to the pool daemon"))?;
        let mut line = String::new();
        if self
            .reader
            .read_line(&mut line)
            .map_err(io("read the pool daemon's reply"))?
            == 0
        {
            return Err(PoolError::Protocol("the pool daemon is gone".into()));
        }
        let reply: Reply = serde_json::from_str(&line)
            .map_err(|e| PoolError::Protocol(format!("unreadable reply: {e}")))?;
        match reply.error {
            Some(error) => Err(PoolError::Protocol(error)),
            None => Ok(reply),
        }
    }

    /// Offers private pages and releases pool pages; returns the pages to merge.
    pub fn offer(
        &mut self,
        pages: Vec<(u64, u64)>,
        released: Vec<u64>,
    ) -> Result<Reply, PoolError> {
        self.call(&Request::Offer { pages, released })
    }

    /// Confirms the pages now mapped from the pool.
    pub fn merged(&mut self, pages: Vec<u64>) -> Result<Reply, PoolError> {
        self.call(&Request::Merged { pages })
    }
}
