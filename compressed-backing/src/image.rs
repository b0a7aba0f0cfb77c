//! Packing a raw RAM file into a store and unpacking it again: what the `pack` and `unpack`
//! commands do, usable from any program.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::bulk::{self, BulkOptions, BulkReport, FileSource};
use crate::codec::{BlockKind, CodecConfig};
use crate::file::{self, FileError};
use crate::layout::BlockSize;
use crate::store::{DiskStore, StoreConfig, StoreError, StoreStats};

/// Choices for `pack`; `None` keeps the existing store's setting (or the default for a new
/// store).
#[derive(Debug, Clone, Copy, Default)]
pub struct PackOptions {
    /// Codec for the packed blocks.
    pub codec: Option<CodecConfig>,
    /// Block size; must match an existing store's.
    pub block_size: Option<BlockSize>,
    /// Parallelism.
    pub bulk: BulkOptions,
    /// A new store's segment size, the most bytes of one segment file (one chunk object in
    /// an object store); an existing store keeps its own.
    pub segment_bytes: Option<u64>,
}

/// Errors of packing and unpacking beyond the store's own.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The raw file could not be opened, sized or written.
    #[error("{op} {path}")]
    File {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The raw file (or the output's name) is a link, a FIFO or a device.
    #[error(transparent)]
    Refused(FileError),
    /// `pack` into an existing store with another block size.
    #[error("store {dir} has {existing}-byte blocks, not {requested}; pack into a new directory")]
    BlockSizeMismatch {
        /// The store.
        dir: PathBuf,
        /// Its block size.
        existing: u64,
        /// The one asked for.
        requested: u64,
    },
}

fn file_error(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ImageError {
    let path = path.to_path_buf();
    move |source| ImageError::File { op, path, source }
}

/// Packs the raw RAM file `mem_file` into the store at `dir`, creating the store if needed or
/// replacing the image of an existing one (its old payloads are reclaimed). The new image is
/// committed only when every block is written; on error the store keeps its previous image.
pub fn pack_file(
    mem_file: &Path,
    dir: &Path,
    options: &PackOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(BulkReport, StoreStats), ImageError> {
    // Never a FIFO (whose open or read would block), a device or a link.
    let file = file::open_read(mem_file).map_err(ImageError::Refused)?;
    let image_size = file.metadata().map_err(file_error("stat", mem_file))?.len();
    let mut store = match DiskStore::open(dir) {
        Ok(mut store) => {
            if let Some(requested) = options.block_size {
                if requested != store.block_size() {
                    return Err(ImageError::BlockSizeMismatch {
                        dir: dir.to_path_buf(),
                        existing: store.block_size().bytes_u64(),
                        requested: requested.bytes_u64(),
                    });
                }
            }
            if let Some(codec) = options.codec {
                store.set_codec(codec);
            }
            store.reset(image_size)?;
            store
        }
        Err(StoreError::NotAStore { .. }) => {
            let mut store_options = crate::store::StoreOptions::default();
            if let Some(bytes) = options.segment_bytes {
                store_options.segment_max_bytes = bytes;
            }
            DiskStore::create_with(
                dir,
                StoreConfig {
                    block_size: options.block_size.unwrap_or_default(),
                    codec: options.codec.unwrap_or_default(),
                    image_size,
                },
                store_options,
            )?
        }
        Err(e) => return Err(e.into()),
    };
    let source = FileSource::new(&file, store.block_size().bytes_u64());
    let blocks = bulk::all_blocks(&store);
    let written = bulk::write_blocks(&mut store, &source, &blocks, &options.bulk, progress)
        .and_then(|report| store.commit().map(|_| report));
    match written {
        Ok(report) => Ok((report, store.stats())),
        // The new image is durable; only the clean-up after it failed.
        Err(e @ StoreError::CompactionFailed { .. }) => Err(e.into()),
        Err(e) => {
            // Keep the previous image; the error that matters is the first one.
            let _ = store.rollback();
            Err(e.into())
        }
    }
}

/// Writes the image of the store at `dir` to the raw file `out` (sparse where blocks are
/// zero), 0600. The file appears under its name only once complete and synced; an existing
/// `out` is replaced only if it is a regular file (never through a link, never a FIFO).
pub fn unpack_file(
    dir: &Path,
    out: &Path,
    options: &BulkOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<BulkReport, ImageError> {
    let store = DiskStore::open_read_only(dir)?;
    file::check_absent_or_regular(out).map_err(ImageError::Refused)?;
    let tmp = temp_name(out);
    // A stale temporary file (or a link planted there) is unlinked, never written through;
    // the new one is 0600 from the start: it holds guest memory.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(file_error("remove", &tmp)(e));
        }
        _ => {}
    }
    let file = file::create_private(&tmp).map_err(ImageError::Refused)?;
    let result = (|| {
        file.set_len(store.image_size())
            .map_err(file_error("size", &tmp))?;
        let block_size = store.block_size().bytes_u64();
        let report = bulk::read_blocks(
            &store,
            &bulk::all_blocks(&store),
            options,
            &|block, kind, bytes| match kind {
                None | Some(BlockKind::Zero) => Ok(()),
                Some(_) => file.write_all_at(bytes, block * block_size),
            },
            progress,
        )?;
        file.sync_all().map_err(file_error("sync", &tmp))?;
        fs::rename(&tmp, out).map_err(file_error("rename to", out))?;
        Ok(report)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn temp_name(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Codec;

    fn write_image(path: &Path, len: usize, seed: u8) -> Vec<u8> {
        let data: Vec<u8> = (0..len)
            .map(|i| {
                if (i / 8192) % 3 == 0 {
                    0
                } else {
                    (i as u8).wrapping_mul(seed) ^ (i >> 9) as u8
                }
            })
            .collect();
        fs::write(path, &data).unwrap();
        data
    }

    #[test]
    fn pack_then_unpack_gives_the_same_bytes_and_a_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("mem");
        let data = write_image(&raw, (4 << 20) + 12288, 3);
        let store_dir = dir.path().join("store");
        let options = PackOptions {
            codec: Some(CodecConfig::new(Codec::Zstd { level: 3 })),
            block_size: Some(BlockSize::new(8192).unwrap()),
            bulk: BulkOptions::with_threads(2),
            segment_bytes: None,
        };
        let (report, stats) = pack_file(&raw, &store_dir, &options, &|_| {}).unwrap();
        assert_eq!(report.bytes, data.len() as u64);
        assert_eq!(stats.image_size, data.len() as u64);
        assert!(
            report.zero_blocks > 0 && report.compressed_blocks > 0,
            "{report:?}"
        );

        let out = dir.path().join("out");
        unpack_file(&store_dir, &out, &BulkOptions::with_threads(2), &|_| {}).unwrap();
        assert!(fs::read(&out).unwrap() == data);
        assert!(!dir.path().join("out.partial").exists());
        assert!(crate::store::allocated_bytes(&out) < data.len() as u64);
    }

    #[test]
    fn pack_again_replaces_the_image_and_reclaims_space() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("mem");
        let store_dir = dir.path().join("store");
        write_image(&raw, 2 << 20, 3);
        let options = PackOptions::default();
        pack_file(&raw, &store_dir, &options, &|_| {}).unwrap();
        let data = write_image(&raw, 1 << 20, 5);
        let (_, stats) = pack_file(&raw, &store_dir, &options, &|_| {}).unwrap();
        assert_eq!(stats.image_size, 1 << 20);
        assert_eq!(stats.dead_bytes, 0, "{stats:?}");
        let out = dir.path().join("out");
        unpack_file(&store_dir, &out, &options.bulk, &|_| {}).unwrap();
        assert!(fs::read(&out).unwrap() == data);
    }

    #[test]
    fn pack_with_another_block_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("mem");
        let store_dir = dir.path().join("store");
        write_image(&raw, 1 << 20, 3);
        pack_file(&raw, &store_dir, &PackOptions::default(), &|_| {}).unwrap();
        let options = PackOptions {
            block_size: Some(BlockSize::new(4096).unwrap()),
            ..PackOptions::default()
        };
        let err = pack_file(&raw, &store_dir, &options, &|_| {}).unwrap_err();
        assert!(matches!(err, ImageError::BlockSizeMismatch { .. }), "{err}");
    }

    use testkit::{mkfifo, mode};

    #[test]
    fn pack_and_unpack_write_owner_only_files() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("mem");
        write_image(&raw, 1 << 20, 3);
        let store_dir = dir.path().join("store");
        pack_file(&raw, &store_dir, &PackOptions::default(), &|_| {}).unwrap();
        assert_eq!(mode(&store_dir), 0o700);
        for entry in fs::read_dir(&store_dir).unwrap() {
            let path = entry.unwrap().path();
            assert_eq!(mode(&path), 0o600, "{}", path.display());
        }
        let out = dir.path().join("out");
        unpack_file(&store_dir, &out, &BulkOptions::default(), &|_| {}).unwrap();
        assert_eq!(mode(&out), 0o600);
    }

    #[test]
    fn pack_of_a_fifo_or_link_is_refused_without_hanging() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let store_dir = dir.path().join("store");
        let (from, to) = (fifo.clone(), store_dir.clone());
        let limit = std::time::Duration::from_secs(10);
        let result = testkit::within(limit, "pack of a FIFO", move || {
            let result = pack_file(&from, &to, &PackOptions::default(), &|_| {});
            result.map(drop).map_err(|e| e.to_string())
        });
        assert!(result.unwrap_err().contains("FIFO"));
        let raw = dir.path().join("mem");
        write_image(&raw, 1 << 20, 3);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&raw, &link).unwrap();
        let err = pack_file(&link, &store_dir, &PackOptions::default(), &|_| {}).unwrap_err();
        assert!(basics::error_chain(&err).contains("symbolic link"), "{err}");
    }

    #[test]
    fn unpack_never_writes_through_a_link_or_into_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("mem");
        let data = write_image(&raw, 1 << 20, 3);
        let store_dir = dir.path().join("store");
        pack_file(&raw, &store_dir, &PackOptions::default(), &|_| {}).unwrap();
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        // A link planted as the temporary file: replaced, not written through.
        let out = dir.path().join("out");
        std::os::unix::fs::symlink(&victim, dir.path().join("out.partial")).unwrap();
        unpack_file(&store_dir, &out, &BulkOptions::default(), &|_| {}).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert!(fs::read(&out).unwrap() == data);
        // A link or a FIFO as the output is refused.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = unpack_file(&store_dir, &link, &BulkOptions::default(), &|_| {}).unwrap_err();
        assert!(basics::error_chain(&err).contains("symbolic link"), "{err}");
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let err = unpack_file(&store_dir, &fifo, &BulkOptions::default(), &|_| {}).unwrap_err();
        assert!(basics::error_chain(&err).contains("FIFO"), "{err}");
    }

    #[test]
    fn pack_of_a_missing_file_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = pack_file(&missing, dir.path(), &PackOptions::default(), &|_| {}).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }
}
