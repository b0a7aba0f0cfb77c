//! The I/O steps of a trajectory (issue 38): downloads, served by the replay server from an
//! origin held to the trajectory's download rate, and reads of the VM's image, whose files
//! the replay writes into an image directory served at the image rate. Their bytes are
//! computable, like the model's answers, and every `download` and `read` the replay runs
//! carries its length and digest, so the guest's command fails on a single wrong byte.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::channel::Channel;
use hyper::body::Bytes;

use super::{answer, Step, Trajectory};
use crate::script::{Command, Expect};

/// The origin's rate of a trajectory's downloads unless it says otherwise: 8 MiB/s.
pub const DEFAULT_DOWNLOAD_RATE: u64 = 8 << 20;
/// The image origin's rate unless the trajectory says otherwise: 40 MiB/s.
pub const DEFAULT_IMAGE_RATE: u64 = 40 << 20;
/// Largest download or image file of a step: 1 GiB (what a replay VM's memory holds, at
/// most).
pub const MAX_IO_BYTES: u64 = 1 << 30;

/// The body seeds of downloads and image files, apart from the model answers' ids.
const DOWNLOAD_SEED: u64 = 1 << 40;
const READ_SEED: u64 = 2 << 40;

/// How the origin sends a download: pieces of this many bytes, paced at its rate.
const PIECE: usize = 64 << 10;

/// The body of download `k` (counting download steps from 1).
pub fn download_body(k: u64, bytes: u64) -> Vec<u8> {
    answer(DOWNLOAD_SEED + k, bytes)
}

impl Trajectory {
    /// The download steps: (k, bytes).
    pub fn downloads(&self) -> Vec<(u64, u64)> {
        self.steps
            .iter()
            .filter_map(|step| match step {
                Step::Download { bytes } => Some(*bytes),
                _ => None,
            })
            .zip(1..)
            .map(|(bytes, k)| (k, bytes))
            .collect()
    }

    /// The files the read steps read, by path: their lengths and body seeds.
    pub fn image_files(&self) -> BTreeMap<String, (u64, u64)> {
        let mut files = BTreeMap::new();
        for step in &self.steps {
            if let Step::Read { path, bytes } = step {
                let next = READ_SEED + files.len() as u64;
                files.entry(path.clone()).or_insert((*bytes, next));
            }
        }
        files
    }

    /// The origin's download rate as replayed: the recorded one over the time scale (a
    /// replay 20 times faster downloads 20 times faster).
    pub fn download_rate_replayed(&self) -> f64 {
        self.download_rate.unwrap_or(DEFAULT_DOWNLOAD_RATE) as f64 / self.time_scale
    }

    /// The image origin's rate as replayed, bytes a second (see `download_rate_replayed`).
    #[allow(
        clippy::cast_sign_loss,
        clippy::cast_possible_truncation,
        clippy::cast_precision_loss,
        reason = "a positive rate over a scale in (0, 100], checked at load"
    )]
    pub fn image_rate_replayed(&self) -> u64 {
        (self.image_rate.unwrap_or(DEFAULT_IMAGE_RATE) as f64 / self.time_scale).max(1.0) as u64
    }

    /// Checks an I/O step (`n` its position): sizes, paths, and one length per path (`files`:
    /// [`Trajectory::image_files`], each path's first length).
    pub(super) fn check_io(
        &self,
        n: usize,
        step: &Step,
        files: &BTreeMap<String, (u64, u64)>,
    ) -> Result<(), String> {
        let bytes = match step {
            Step::Download { bytes } => *bytes,
            Step::Read { path, bytes } => {
                crate::image::check_path(path).map_err(|e| format!("step {n} (read): {e}"))?;
                if files.get(path).map(|f| f.0) != Some(*bytes) {
                    return Err(format!(
                        "step {n} (read): `{path}` is read with two lengths"
                    ));
                }
                *bytes
            }
            Step::Model { .. } | Step::Tool { .. } => return Ok(()),
        };
        if bytes == 0 || bytes > MAX_IO_BYTES {
            return Err(format!(
                "step {n}: {bytes} bytes (from 1 byte to {MAX_IO_BYTES})"
            ));
        }
        for rate in [self.download_rate, self.image_rate].into_iter().flatten() {
            if rate == 0 {
                return Err("a rate of 0 bytes a second".into());
            }
        }
        Ok(())
    }

    /// The digests of the image's files, by path.
    pub(super) fn image_digests(&self) -> BTreeMap<String, u64> {
        self.image_files()
            .into_iter()
            .map(|(path, (bytes, seed))| (path, crate::guest::digest(&answer(seed, bytes))))
            .collect()
    }

    /// The commands of I/O step `step`, the `k`th download if it is one, for a VM whose
    /// downloads come from `origin`: with the length and digest they must have (a file's
    /// from `digests`, [`Trajectory::image_digests`]).
    pub(super) fn io_command(
        step: &Step,
        k: u64,
        origin: &str,
        digests: &BTreeMap<String, u64>,
    ) -> Option<Command> {
        match step {
            Step::Download { bytes } => Some(Command::Download {
                url: format!("{origin}/downloads/{k}"),
                expect: Expect {
                    bytes: Some(*bytes),
                    digest: Some(crate::guest::digest(&download_body(k, *bytes))),
                },
            }),
            Step::Read { path, bytes } => Some(Command::Read {
                path: path.clone(),
                expect: Expect {
                    bytes: Some(*bytes),
                    digest: digests.get(path).copied(),
                },
            }),
            Step::Model { .. } | Step::Tool { .. } => None,
        }
    }

    /// Writes the files of the read steps into `dir` (made if absent) and indexes it as an
    /// image (`pvisor run --vm-image DIR`). Only the files read are written.
    pub fn write_image(&self, dir: &Path) -> Result<(), String> {
        for (path, (bytes, seed)) in self.image_files() {
            let file = dir.join(&path);
            if let Some(parent) = file.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("{}: {e}", parent.display()))?;
            }
            std::fs::write(&file, answer(seed, bytes))
                .map_err(|e| format!("{}: {e}", file.display()))?;
        }
        crate::image::index(dir)
            .map(drop)
            .map_err(|e| basics::error_chain(&e))
    }
}

/// The downloads the replay server serves: their lengths, the rate, and the bodies made so
/// far (each once, shared by every VM).
#[derive(Debug)]
pub(super) struct Downloads {
    lengths: Vec<(u64, u64)>,
    rate: f64,
    bodies: Mutex<BTreeMap<u64, Bytes>>,
}

impl Downloads {
    pub(super) fn of(trajectory: &Trajectory) -> Arc<Self> {
        Arc::new(Self {
            lengths: trajectory.downloads(),
            rate: trajectory.download_rate_replayed(),
            bodies: Mutex::new(BTreeMap::new()),
        })
    }

    fn body(&self, k: u64) -> Option<Bytes> {
        let &(_, bytes) = self.lengths.iter().find(|d| d.0 == k)?;
        let mut bodies = self
            .bodies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(
            bodies
                .entry(k)
                .or_insert_with(|| Bytes::from(download_body(k, bytes)))
                .clone(),
        )
    }

    /// Download `k`'s body, streamed at the origin's rate (its length announced), or `None`
    /// if the trajectory has no such download.
    pub(super) fn serve(self: &Arc<Self>, k: u64) -> Option<(u64, Channel<Bytes>)> {
        let body = self.body(k)?;
        let len = body.len() as u64;
        let rate = self.rate;
        let (mut sender, channel) = Channel::new(4);
        tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let mut sent = 0usize;
            while sent < body.len() {
                let end = (sent + PIECE).min(body.len());
                if sender.send_data(body.slice(sent..end)).await.is_err() {
                    // The client went away.
                    return;
                }
                sent = end;
                let due = Duration::from_secs_f64(sent as f64 / rate);
                tokio::time::sleep_until(started + due).await;
            }
        });
        Some((len, channel))
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use std::io::{Read, Write};

    fn sample() -> Trajectory {
        serde_json::from_str(
            r#"{"name": "io", "download_rate": 4194304, "image_rate": 1048576, "time_scale": 0.5,
                "steps": [
                {"model": {"wait_ms": 20, "answer_bytes": 100}},
                {"download": {"bytes": 300000}},
                {"read": {"path": "lib/a.so", "bytes": 5000}},
                {"tool": {"script": "fill 1MiB random seed=2; digest"}},
                {"download": {"bytes": 10}},
                {"read": {"path": "lib/a.so", "bytes": 5000}}
            ]}"#,
        )
        .expect("a trajectory")
    }

    #[test]
    fn io_steps_become_downloads_and_reads_with_their_length_and_digest() {
        let t = sample();
        t.check().expect("valid");
        assert_eq!(t.downloads(), [(1, 300_000), (2, 10)]);
        assert_eq!(t.has_io(), (true, true));
        // Replayed twice as fast: the rates double.
        assert_eq!(t.download_rate_replayed(), 8_388_608.0);
        assert_eq!(t.image_rate_replayed(), 2 << 20);
        let script: Vec<String> = t
            .script("http://o:1")
            .iter()
            .map(ToString::to_string)
            .collect();
        let body = download_body(1, 300_000);
        assert_eq!(
            script[1],
            format!(
                "download http://o:1/downloads/1 bytes=300000 digest={}",
                crate::guest::digest_hex(&body)
            )
        );
        assert!(
            script[2].starts_with("read lib/a.so bytes=5000 digest="),
            "{}",
            script[2]
        );
        assert_eq!(script[2], script[6]);
        assert!(script[5].starts_with("download http://o:1/downloads/2 bytes=10 "));
        // Every command parses back as it prints.
        for line in &script {
            assert_eq!(
                &crate::script::parse(line).expect("parses")[0].to_string(),
                line
            );
        }
        // The image holds the file the reads expect.
        let dir = tempfile::tempdir().expect("a directory");
        t.write_image(dir.path()).expect("written");
        let file = std::fs::read(dir.path().join("lib/a.so")).expect("the file");
        assert!(script[2].ends_with(&crate::guest::digest_hex(&file)));
        assert!(dir.path().join(crate::image::MANIFEST).exists());
    }

    #[test]
    fn io_steps_are_checked() {
        let bad = |steps: &str| {
            let text = format!(r#"{{"name": "t", "steps": [{steps}]}}"#);
            let t: Trajectory = serde_json::from_str(&text).expect("json");
            t.check().expect_err("refused")
        };
        assert!(bad(r#"{"download": {"bytes": 0}}"#).contains("bytes"));
        assert!(bad(r#"{"download": {"bytes": 2000000000}}"#).contains("bytes"));
        assert!(bad(r#"{"read": {"path": "../x", "bytes": 1}}"#).contains("relative"));
        let twice = r#"{"read": {"path": "a", "bytes": 1}}, {"read": {"path": "a", "bytes": 2}}"#;
        assert!(bad(twice).contains("two lengths"));
    }

    #[test]
    fn server_streams_a_download_at_its_rate_with_its_length() {
        let t = sample();
        let server = ReplayServer::start(&t).expect("a server");
        let get = |path: &str| {
            let mut stream =
                std::net::TcpStream::connect(server.url().trim_start_matches("http://"))
                    .expect("connect");
            write!(stream, "GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").expect("send");
            let mut reply = Vec::new();
            stream.read_to_end(&mut reply).expect("read");
            reply
        };
        // 300000 bytes at 8 MiB/s (4 MiB/s recorded, replayed twice as fast): ~36 ms.
        let started = std::time::Instant::now();
        let reply = get("/downloads/1");
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(30), "{took:?}");
        let head_end = reply
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a head")
            + 4;
        let head = String::from_utf8_lossy(&reply[..head_end]).to_ascii_lowercase();
        assert!(head.contains("content-length: 300000"), "{head}");
        assert!(reply[head_end..] == download_body(1, 300_000)[..]);
        let missing = String::from_utf8_lossy(&get("/downloads/3")).into_owned();
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    }
}
