//! Lazy images (issue 38, the seed's third wait): a read-only file tree for the guest
//! (`--vm-image DIR|s3://BUCKET/PREFIX|http://HOST[:PORT]/PATH`), whose files are fetched
//! from their origin on the first read, checked against the image's manifest and staged on the
//! host (in the VM's runtime directory, or one shared by the VMs of the image); later reads of
//! the same file are served from the staging. The guest's `read PATH` waits on the fetch like a
//! download waits on its next chunk (`vmm::net`'s channel, kind READ): the host fetches,
//! verifies and stages while the VM sleeps (paused, offloaded), resumes it, and only then
//! writes the reply into its RAM (the seed's RAM gate).
//!
//! The manifest, `image.json` at the image's root, lists every file the guest may read with
//! its length and xxh3-128 (`pvisor image index DIR` writes it): nothing else is fetched, and
//! a file whose bytes differ from it is an error, never handed over. The digest guards
//! against a truncated or corrupted origin; the manifest is trusted as the operator gave it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use compressed_backing::file;

use crate::gateway::{Failure, FailureKind};

/// The manifest's name at the image's root.
pub const MANIFEST: &str = "image.json";
/// The manifest version this host reads.
pub const VERSION: u32 = 1;
/// Largest manifest, bytes.
pub const MANIFEST_LIMIT: u64 = 16 << 20;
/// Longest path of a file in an image, bytes.
pub const PATH_MAX: usize = 1024;
/// How long an HTTP origin may send nothing before its fetch is given up.
const HTTP_STALL: Duration = Duration::from_secs(30);
/// The slowest an HTTP origin may send a file in all, bytes a second (a fetch of N bytes is
/// given up after 30 s plus N at this rate, however it trickles).
const HTTP_MIN_RATE: u64 = 256 << 10;

/// One file of an image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Its path from the image's root (`/`-separated, no `.` or `..`).
    pub path: String,
    /// Its length.
    pub bytes: u64,
    /// Its xxh3-128, 32 hex digits.
    pub xxh3_128: String,
}

/// An image's manifest (`image.json`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`VERSION`].
    pub version: u32,
    /// Its files.
    pub files: Vec<FileEntry>,
}

/// Errors opening or indexing an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file could not be read.
    #[error("image file")]
    File(#[from] file::FileError),
    /// The manifest is not one this host reads.
    #[error("image manifest {at}: {reason}")]
    Manifest {
        /// Where.
        at: String,
        /// Why.
        reason: String,
    },
    /// The object store failed.
    #[error("image in an object store")]
    Remote(#[from] compressed_backing::remote::RemoteError),
    /// Listing or staging failed.
    #[error("{what} {}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// To what.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Drops `file`'s pages from the page cache: the page cache is charged to the VM's memory
/// cgroup, and a staged or origin file is read once per read, rarely.
fn uncache(file: &std::fs::File) {
    // SAFETY: posix_fadvise on a descriptor we own; no memory is passed. Advice only: a
    // failure leaves the pages cached, nothing else.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// The regular file at `path` (no link followed: [`file::open_read`]) read to its end, at
/// most `len` bytes and one more (which tells a longer file), its pages dropped from the page
/// cache after.
fn read_uncached(path: &Path, len: u64) -> Result<Vec<u8>, String> {
    let mut file = file::open_read(path).map_err(|e| basics::error_chain(&e))?;
    let mut bytes = Vec::new();
    (&mut file)
        .take(len.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    uncache(&file);
    Ok(bytes)
}

/// Whether `path` names a file inside an image: relative, `/`-separated plain names.
pub fn check_path(path: &str) -> Result<(), String> {
    let plain = !path.is_empty()
        && path.len() <= PATH_MAX
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
        && !path.contains('\0');
    if plain {
        Ok(())
    } else {
        Err(format!(
            "`{}`: an image path is relative, of plain names separated by `/`, at most {PATH_MAX} bytes",
            path.escape_default()
        ))
    }
}

impl Manifest {
    /// Reads a manifest's text, checking every entry: a known version, paths plain and
    /// unique, digests of 32 hex digits.
    pub fn parse(text: &[u8], at: &str) -> Result<Self, ImageError> {
        let bad = |reason: String| ImageError::Manifest {
            at: at.to_owned(),
            reason,
        };
        let manifest: Manifest = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
        if manifest.version != VERSION {
            return Err(bad(format!(
                "version {}; this host reads version {VERSION}",
                manifest.version
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        for entry in &manifest.files {
            check_path(&entry.path).map_err(bad)?;
            let hex =
                entry.xxh3_128.len() == 32 && entry.xxh3_128.bytes().all(|b| b.is_ascii_hexdigit());
            if !hex {
                return Err(bad(format!(
                    "`{}`: its xxh3_128 is not 32 hex digits",
                    entry.path
                )));
            }
            if !seen.insert(entry.path.as_str()) {
                return Err(bad(format!("`{}` is listed twice", entry.path)));
            }
        }
        Ok(manifest)
    }
}

/// The xxh3-128 of `bytes`, as a manifest writes it.
pub fn digest(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// Indexes the regular files under `dir` and writes `dir/image.json`; returns the manifest,
/// and what was left out and why (symbolic links, special files, names not UTF-8).
pub fn index(dir: &Path) -> Result<(Manifest, Vec<String>), ImageError> {
    let mut files = Vec::new();
    let mut left_out = Vec::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        let here = dir.join(&relative);
        let entries = std::fs::read_dir(&here).map_err(|source| ImageError::Io {
            what: "list",
            path: here.clone(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| ImageError::Io {
                what: "list",
                path: here.clone(),
                source,
            })?;
            let name = relative.join(entry.file_name());
            let kind = entry.file_type().map_err(|source| ImageError::Io {
                what: "stat",
                path: entry.path(),
                source,
            })?;
            let Some(path) = name.to_str().map(str::to_owned) else {
                left_out.push(format!("{}: not UTF-8", name.display()));
                continue;
            };
            if kind.is_dir() {
                pending.push(name);
            } else if kind.is_file() && path != MANIFEST {
                check_path(&path).map_err(|reason| ImageError::Manifest {
                    at: dir.display().to_string(),
                    reason,
                })?;
                let bytes = file::read_bounded(&entry.path(), u64::MAX)?;
                files.push(FileEntry {
                    path,
                    bytes: bytes.len() as u64,
                    xxh3_128: digest(&bytes),
                });
            } else if path != MANIFEST {
                left_out.push(format!("{path}: not a regular file or directory"));
            }
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let manifest = Manifest {
        version: VERSION,
        files,
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| ImageError::Manifest {
        at: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let target = dir.join(MANIFEST);
    std::fs::write(&target, text).map_err(|source| ImageError::Io {
        what: "write",
        path: target,
        source,
    })?;
    Ok((manifest, left_out))
}

/// Where an image is.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum ImageLocation {
    /// A directory.
    Dir(PathBuf),
    /// A prefix of an object store.
    Remote(crate::vm::RemoteSnapshot),
    /// A plain-HTTP origin: the URL of the image's root (`http://HOST[:PORT][/PATH]`), each
    /// file fetched with one GET of the root's URL, `/`, its path.
    Http(String),
}

impl ImageLocation {
    /// `DIR`, `s3://BUCKET/PREFIX` or `http://HOST[:PORT][/PATH]`, as a user writes it; a
    /// directory is made absolute.
    pub fn parse(
        text: &str,
        remote: &compressed_backing::remote::RemoteOptions,
    ) -> Result<Self, String> {
        use compressed_backing::remote::StoreLocation;
        if text
            .get(..7)
            .is_some_and(|p| p.eq_ignore_ascii_case("http://"))
        {
            let root = crate::net::Target::parse(text)?;
            if text.contains('?') {
                return Err(format!(
                    "image origin `{text}`: no query, the URL of a root"
                ));
            }
            return Ok(Self::Http(format!(
                "http://{}{}",
                root.authority(),
                root.path()
            )));
        }
        let scheme = text.split_once("://").map(|(scheme, _)| scheme);
        if scheme.is_some_and(|s| !s.is_empty() && !s.eq_ignore_ascii_case("s3")) {
            return Err(format!(
                "image `{text}`: expected a directory, s3://BUCKET/PREFIX or \
                 http://HOST[:PORT]/PATH"
            ));
        }
        Ok(
            match StoreLocation::parse(text).map_err(|e| e.to_string())? {
                StoreLocation::Local(dir) => {
                    Self::Dir(std::path::absolute(dir).map_err(|e| format!("{text}: {e}"))?)
                }
                StoreLocation::Remote(url) => {
                    Self::Remote(crate::vm::RemoteSnapshot::new(&url, remote, None))
                }
            },
        )
    }

    /// Reads and checks the manifest of the image here: what a starter checks before any VM
    /// is to read it.
    pub fn manifest(&self) -> Result<Manifest, ImageError> {
        reach(self).map(|(_, manifest)| manifest)
    }
}

/// The origin of the image at `location`, and its manifest read from there and checked.
fn reach(location: &ImageLocation) -> Result<(Origin, Manifest), ImageError> {
    let (origin, text, at) = match location {
        ImageLocation::Dir(dir) => {
            let at = dir.join(MANIFEST);
            let text = file::read_bounded(&at, MANIFEST_LIMIT)?;
            (Origin::Dir(dir.clone()), text, at.display().to_string())
        }
        ImageLocation::Remote(remote) => {
            let remote = remote.remote().map_err(|e| ImageError::Manifest {
                at: remote.url.clone(),
                reason: basics::error_chain(&e),
            })?;
            let at = format!("{}/{MANIFEST}", remote.url());
            let text = remote
                .get_bounded(MANIFEST, MANIFEST_LIMIT)?
                .ok_or_else(|| ImageError::Manifest {
                    at: at.clone(),
                    reason: "there is no image there (no manifest)".into(),
                })?;
            (Origin::Remote(Box::new(remote)), text, at)
        }
        ImageLocation::Http(root) => {
            let root = root.trim_end_matches('/').to_owned();
            let at = http_url(&root, MANIFEST);
            let bad = |reason: String| ImageError::Manifest {
                at: at.clone(),
                reason,
            };
            let text = http_get(&at, MANIFEST_LIMIT).map_err(|f| bad(f.message))?;
            (Origin::Http(root), text, at.clone())
        }
    };
    let manifest = Manifest::parse(&text, &at)?;
    Ok((origin, manifest))
}

/// How a VM's image is served (`--vm-image*`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ImageOptions {
    /// Where it is.
    pub at: ImageLocation,
    /// Where fetched files are staged: private to this user (the VM's job directory, or one
    /// that VMs of the image share).
    pub staging: PathBuf,
    /// The origin's rate, bytes a second, if it is to be held to one (a slow origin modelled
    /// on a fast one: `--vm-image-rate`); `None`: as fast as it serves.
    #[serde(default)]
    pub rate: Option<u64>,
}

enum Origin {
    Dir(PathBuf),
    Remote(Box<compressed_backing::remote::Remote>),
    /// The root's URL, without a trailing `/`.
    Http(String),
}

/// `root`/`path` as a URL, the path's bytes other than letters, digits, `/-._~` escaped.
fn http_url(root: &str, path: &str) -> String {
    let mut url = String::with_capacity(root.len() + 1 + path.len());
    url.push_str(root);
    url.push('/');
    for &b in path.as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            url.push(char::from(b));
        } else {
            url.push_str(&format!("%{b:02X}"));
        }
    }
    url
}

/// The body of `GET url`, at most `limit` bytes, given up after [`HTTP_STALL`] of silence or
/// once slower than [`HTTP_MIN_RATE`] in all. Blocking, on a thread and runtime of its own, so
/// that any thread may call it (a command's, a gateway's blocking task) and no other runtime's
/// end cuts it short.
fn http_get(url: &str, limit: u64) -> Result<Vec<u8>, Failure> {
    let target = crate::net::Target::parse(url)?;
    let most = HTTP_STALL + Duration::from_secs(limit / HTTP_MIN_RATE);
    let fetch = || -> Result<Vec<u8>, Failure> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime for GET {url}: {e}"))?;
        runtime.block_on(async {
            let get = crate::gateway::get_whole(&target, limit, HTTP_STALL);
            tokio::time::timeout(most, get).await.unwrap_or_else(|_| {
                let why = format!("GET {url}: not done within {} s", most.as_secs());
                Err(Failure::new(FailureKind::TimedOut, why))
            })
        })
    };
    std::thread::scope(|scope| {
        scope
            .spawn(fetch)
            .join()
            .unwrap_or_else(|_| Err(format!("GET {url}: its thread panicked").into()))
    })
}

/// An open image: its manifest and its origin.
pub struct Image {
    origin: Origin,
    files: BTreeMap<String, FileEntry>,
    staging: PathBuf,
    rate: Option<u64>,
    /// Held by the one fetch under way: a read given up does not stop its fetch, and a
    /// guest that asks for file after file must not have them all in memory at once.
    fetching: std::sync::Mutex<()>,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("files", &self.files.len())
            .field("staging", &self.staging)
            .finish_non_exhaustive()
    }
}

/// A file read for the guest.
#[derive(Debug)]
pub struct Fetched {
    /// Its bytes, verified.
    pub bytes: Vec<u8>,
    /// Served from the staging (no trip to the origin).
    pub staged: bool,
}

impl Image {
    /// Opens the image `options` describe: reads its manifest and creates the staging
    /// directory (private).
    pub fn open(options: &ImageOptions) -> Result<Self, ImageError> {
        let (origin, manifest) = reach(&options.at)?;
        // Perhaps shared by the VMs of the image (`--vm-image-staging`): ours alone to write.
        file::create_private_dir(&options.staging)
            .and_then(|()| crate::runtime::not_private(&options.staging))
            .and_then(|why| match why {
                None => Ok(()),
                Some(why) => Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    why,
                )),
            })
            .map_err(|source| ImageError::Io {
                what: "use the staging directory",
                path: options.staging.clone(),
                source,
            })?;
        Ok(Self {
            origin,
            files: manifest
                .files
                .into_iter()
                .map(|entry| (entry.path.clone(), entry))
                .collect(),
            staging: options.staging.clone(),
            rate: options.rate.filter(|&r| r > 0),
            fetching: std::sync::Mutex::new(()),
        })
    }

    /// The entry of `path`, if the image has it.
    pub fn entry(&self, path: &str) -> Option<&FileEntry> {
        self.files.get(path)
    }

    /// How long the origin is expected to take for `path`: its length at the origin's rate,
    /// if it is held to one and the file is not staged yet.
    pub fn expected(&self, path: &str) -> Option<Duration> {
        let entry = self.entry(path)?;
        if self.staged_path(entry).exists() {
            return Some(Duration::ZERO);
        }
        let rate = self.rate?;
        Some(Duration::from_secs_f64(entry.bytes as f64 / rate as f64))
    }

    fn staged_path(&self, entry: &FileEntry) -> PathBuf {
        self.staging.join(&entry.xxh3_128)
    }

    /// Reads `path` for the guest (blocking): from the staging if it was fetched before,
    /// else from the origin (held to its rate), checked against the manifest and staged.
    /// Why not, if it cannot (an origin that timed out is [`FailureKind::TimedOut`]).
    pub fn fetch(&self, path: &str) -> Result<Fetched, Failure> {
        let entry = self
            .entry(path)
            .ok_or_else(|| format!("`{path}` is not in the image"))?;
        let _one = self
            .fetching
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let staged = self.staged_path(entry);
        if let Ok(bytes) = read_uncached(&staged, entry.bytes) {
            if bytes.len() as u64 == entry.bytes && digest(&bytes) == entry.xxh3_128 {
                return Ok(Fetched {
                    bytes,
                    staged: true,
                });
            }
        }
        let started = Instant::now();
        let bytes = match &self.origin {
            Origin::Dir(dir) => self.read_dir_file(dir, entry)?,
            Origin::Remote(remote) => remote
                .get_bounded(&entry.path, entry.bytes)
                .map_err(|e| format!("`{path}`: {}", basics::error_chain(&e)))?
                .ok_or_else(|| format!("`{path}` is listed but missing at the origin"))?,
            // One byte more than the manifest's tells a longer file.
            Origin::Http(root) => http_get(&http_url(root, &entry.path), entry.bytes + 1)
                .map_err(|f| Failure::new(f.kind, format!("`{path}`: {}", f.message)))?,
        };
        if let Some(rate) = self.rate {
            // The modelled origin delivers at its rate: the rest of the time it would take.
            let due = Duration::from_secs_f64(bytes.len() as f64 / rate as f64);
            std::thread::sleep(due.saturating_sub(started.elapsed()));
        }
        if bytes.len() as u64 != entry.bytes || digest(&bytes) != entry.xxh3_128 {
            return Err(format!(
                "`{path}` at the origin ({} bytes, xxh3-128 {}) differs from the image's manifest ({} bytes, {})",
                bytes.len(),
                digest(&bytes),
                entry.bytes,
                entry.xxh3_128
            )
            .into());
        }
        // Staged under a fresh name, then renamed: a staged file is always whole. Written
        // back and dropped from the page cache (charged to the VM otherwise). A failure to
        // stage costs a later read another trip, nothing else.
        // Named for this process and this fetch too: a staging directory may be shared, by
        // VMs of other processes and of this one.
        static FETCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let fetch = FETCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let partial = self.staging.join(format!(
            ".{}.{}.{fetch}.part",
            entry.xxh3_128,
            std::process::id()
        ));
        let _ = std::fs::remove_file(&partial);
        let written = file::create_private(&partial)
            .map_err(std::io::Error::other)
            .and_then(|mut f| {
                f.write_all(&bytes)?;
                f.sync_data()?;
                uncache(&f);
                Ok(())
            })
            .and_then(|()| std::fs::rename(&partial, &staged));
        if written.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        Ok(Fetched {
            bytes,
            staged: false,
        })
    }

    /// `entry` from the image directory `dir`: a regular file inside it (no link followed
    /// out of it), at most the manifest's length (one byte more tells a longer file).
    fn read_dir_file(&self, dir: &Path, entry: &FileEntry) -> Result<Vec<u8>, String> {
        let path = dir.join(&entry.path);
        let inside = |p: &Path| -> bool {
            match (p.canonicalize(), dir.canonicalize()) {
                (Ok(p), Ok(d)) => p.starts_with(d),
                _ => false,
            }
        };
        let parent_inside = path.parent().is_some_and(inside);
        let plain = Path::new(&entry.path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
        if !(parent_inside && plain) {
            return Err(format!("`{}` is outside the image directory", entry.path));
        }
        read_uncached(&path, entry.bytes)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn image_locations_are_told_apart_and_paths_escaped_in_urls() {
        let remote = compressed_backing::remote::RemoteOptions::new();
        let parse = |text: &str| ImageLocation::parse(text, &remote);
        assert!(matches!(parse("/srv/image"), Ok(ImageLocation::Dir(_))));
        assert!(matches!(
            parse("s3://images/base"),
            Ok(ImageLocation::Remote(_))
        ));
        match parse("HTTP://Mirror:8080/images/base") {
            Ok(ImageLocation::Http(root)) => assert_eq!(root, "http://mirror:8080/images/base"),
            other => panic!("{other:?}"),
        }
        for bad in [
            "ftp://mirror/image",
            "https://mirror/image",
            "http://mirror/image?x=1",
            "http://mir ror/image",
            "ht\u{e9}tp://x",
            "h\u{e9}://x",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            http_url("http://h:80/root", "etc/a b%+c.so"),
            "http://h:80/root/etc/a%20b%25%2Bc.so"
        );
    }

    #[test]
    fn paths_are_plain_relative_names() {
        for ok in ["a", "usr/lib/x.so", "a.b/c-d_e"] {
            assert!(check_path(ok).is_ok(), "{ok}");
        }
        let long = "a/".repeat(600);
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "./a",
            "a//b",
            "a/",
            "..",
            "a\0b",
            &long,
        ] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn index_and_fetch_check_every_byte_and_stage_what_they_fetched() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("image");
        std::fs::create_dir_all(root.join("usr/lib")).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(root.join("usr/lib/a.so"), &data).unwrap();
        std::fs::write(root.join("README"), b"hello").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("usr/link")).unwrap();
        let (manifest, left_out) = index(&root).unwrap();
        assert_eq!(left_out, ["usr/link: not a regular file or directory"]);
        let paths: Vec<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["README", "usr/lib/a.so"]);
        let options = ImageOptions {
            at: ImageLocation::Dir(root.clone()),
            staging: dir.path().join("staging"),
            rate: Some(1 << 20),
        };
        let image = Image::open(&options).unwrap();
        // 100000 bytes at 1 MiB/s: about 95 ms.
        let expected = image.expected("usr/lib/a.so").unwrap();
        assert!((90..100).contains(&expected.as_millis()), "{expected:?}");
        let started = Instant::now();
        let fetched = image.fetch("usr/lib/a.so").unwrap();
        assert!(started.elapsed() >= Duration::from_millis(90));
        assert!(!fetched.staged);
        assert_eq!(fetched.bytes, data);
        // Staged: served again at once, and expected so.
        assert_eq!(image.expected("usr/lib/a.so"), Some(Duration::ZERO));
        let again = image.fetch("usr/lib/a.so").unwrap();
        assert!(again.staged);
        assert_eq!(again.bytes, data);
        // Not listed: nothing read; changed at the origin: refused.
        assert!(image
            .fetch("usr/link")
            .unwrap_err()
            .message
            .contains("not in the image"));
        assert!(image.fetch("image.json").is_err());
        std::fs::write(root.join("README"), b"HELLO").unwrap();
        let why = image.fetch("README").unwrap_err();
        assert!(
            why.message.contains("differs from the image's manifest"),
            "{why}"
        );
        std::fs::write(root.join("README"), b"hello, longer").unwrap();
        assert!(image.fetch("README").is_err());
        // A manifest that lists a path twice, or out of the tree, is refused.
        let twice = br#"{"version":1,"files":[
            {"path":"a","bytes":1,"xxh3_128":"00000000000000000000000000000000"},
            {"path":"a","bytes":1,"xxh3_128":"00000000000000000000000000000000"}]}"#;
        assert!(Manifest::parse(twice, "t").is_err());
        let escape = br#"{"version":1,"files":[
            {"path":"../x","bytes":1,"xxh3_128":"00000000000000000000000000000000"}]}"#;
        assert!(Manifest::parse(escape, "t").is_err());
    }
}
