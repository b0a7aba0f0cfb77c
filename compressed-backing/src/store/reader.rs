//! Reading blocks: shared by `DiskStore` and `StoreReader`, a detached read-only view that
//! other threads can use while the store is being written.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use xxhash_rust::xxh3::xxh3_64;

use super::index::{DataRef, Slot};
use super::{segment, StoreError};
use crate::codec::{BlockKind, Decoder};
use crate::layout::BlockSize;

thread_local! {
    /// Per-thread decoder and payload buffer: reads take `&self`.
    static READ_SCRATCH: RefCell<(Decoder, Vec<u8>)> = RefCell::new((Decoder::new(), Vec::new()));
    /// Per-thread buffer of direct reads, aligned inside.
    static DIRECT_SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Alignment of direct reads: offset, length and buffer (the page size; the devices here
/// need 512 bytes).
const DIRECT_ALIGN: usize = 4096;

/// Segment files opened a second time with `O_DIRECT`, for reads that must leave nothing in
/// the page cache (see `DiskStore::set_drop_behind`): such a read goes from the disk straight
/// to our buffer, where a buffered one copies into the page cache, then to us, then drops the
/// cache again (`pread` and `fadvise` were 22–24% of a VM's time in a resume: docs/governor.md).
/// A segment whose file system refuses `O_DIRECT` (or a direct read of it) is read the
/// buffered way.
#[derive(Debug, Default)]
pub(super) struct DirectFiles {
    /// By segment: its direct descriptor, `None` where direct reads are refused.
    files: Mutex<BTreeMap<u32, Option<Arc<File>>>>,
    /// Payloads read directly.
    reads: AtomicU64,
}

impl DirectFiles {
    /// The direct descriptor of segment `id`, whose buffered one is `file`: the same file
    /// opened again through `/proc/self/fd` (it may be unlinked by compaction already).
    fn of(&self, id: u32, file: &File) -> Option<Arc<File>> {
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        files
            .entry(id)
            .or_insert_with(|| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
                    .ok()
                    .map(Arc::new)
            })
            .clone()
    }

    /// Segment `id` is deleted: its direct descriptor goes, so that the file's space can.
    pub(super) fn forget(&self, id: u32) {
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        files.remove(&id);
    }

    /// Direct reads of segment `id` are refused: read it the buffered way from now on.
    fn refuse(&self, id: u32) {
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        files.insert(id, None);
    }

    /// Payloads read directly so far.
    pub(super) fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

/// Reads `out.len()` bytes at `offset` of `file` (opened with `O_DIRECT`): the aligned span
/// around them into an aligned buffer, then the bytes out of it. `UnexpectedEof` if the file
/// ends first; `InvalidInput` (`EINVAL`) if the file system will not read it directly.
fn read_direct(file: &File, offset: u64, out: &mut [u8]) -> io::Result<()> {
    let align = DIRECT_ALIGN as u64;
    let start = offset & !(align - 1);
    let end = (offset + out.len() as u64).div_ceil(align) * align;
    let span =
        usize::try_from(end - start).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    DIRECT_SCRATCH.with(|scratch| {
        let raw = &mut *scratch.borrow_mut();
        if raw.len() < span + DIRECT_ALIGN {
            raw.resize(span + DIRECT_ALIGN, 0);
        }
        let skew = raw.as_ptr().align_offset(DIRECT_ALIGN);
        let aligned = &mut raw[skew..skew + span];
        let mut done = 0;
        while done < span {
            let n = file.read_at(&mut aligned[done..], start + done as u64)?;
            done += n;
            // End of file, or a short read: the next offset would not be aligned.
            if n == 0 || done % DIRECT_ALIGN != 0 {
                break;
            }
        }
        let from = usize::try_from(offset - start).expect("under one alignment");
        if done < from + out.len() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        out.copy_from_slice(&aligned[from..from + out.len()]);
        Ok(())
    })
}

/// Finds the open file of a segment.
pub(super) type FileOf<'a> = dyn Fn(u32) -> Option<&'a File> + 'a;

/// Where a store's segment bytes come from when its files do not hold them: a store whose
/// directory mirrors a remote one (`crate::remote`) has sparse segment files that are filled
/// on demand. Bytes that fail their checksum are fetched and checked once more; bytes that
/// fail again are corrupt where they came from, and the read is an error as for a local store.
pub trait SegmentFill: Send + Sync + std::fmt::Debug {
    /// Fetches the `buf.len()` bytes at `offset` of segment `segment` into `buf`, and keeps
    /// them in the local file for the next read.
    fn fill(
        &self,
        segment: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// How reads treat the segment files: see `DiskStore::set_drop_behind` and [`SegmentFill`];
/// for a sealed store, whether its payloads are sealed and the key that opens them.
#[derive(Debug, Clone, Default)]
pub(super) struct ReadPath {
    pub drop_behind: bool,
    pub fill: Option<Arc<dyn SegmentFill>>,
    pub sealed: bool,
    pub key: Option<(Arc<crate::seal::StoreKey>, Arc<[u8]>)>,
    /// With `drop_behind`: the segments opened for direct reads.
    pub direct: Option<Arc<DirectFiles>>,
}

/// Reads and checks the payload of `block` into `buf`; with `drop_behind`, drops the whole
/// pages it read from the page cache afterwards. With a filler, bytes that fail their check
/// are filled and read once more.
pub(super) fn read_payload(
    dir: &Path,
    block: u64,
    data: &DataRef,
    buf: &mut Vec<u8>,
    how: &ReadPath,
    file_of: &FileOf<'_>,
) -> Result<(), StoreError> {
    let Some(fill) = &how.fill else {
        return read_checked(dir, block, data, buf, how, file_of);
    };
    match read_checked(dir, block, data, buf, how, file_of) {
        Err(StoreError::Corrupt { .. } | StoreError::SegmentTruncated { .. }) => {
            buf.resize(data.len as usize, 0);
            fill.fill(data.segment, data.offset, buf)
                .map_err(|source| StoreError::Fetch {
                    block,
                    path: dir.join(segment::file_name(data.segment)),
                    offset: data.offset,
                    source,
                })?;
            check(dir, block, data, buf)
        }
        other => other,
    }
}

fn read_checked(
    dir: &Path,
    block: u64,
    data: &DataRef,
    buf: &mut Vec<u8>,
    how: &ReadPath,
    file_of: &FileOf<'_>,
) -> Result<(), StoreError> {
    let path = || dir.join(segment::file_name(data.segment));
    let file = file_of(data.segment).ok_or_else(|| StoreError::SegmentMissing { path: path() })?;
    buf.resize(data.len as usize, 0);
    let direct = how
        .direct
        .as_ref()
        .filter(|_| how.drop_behind)
        .and_then(|direct| Some((direct, direct.of(data.segment, file)?)));
    if let Some((direct, direct_file)) = direct {
        match read_direct(&direct_file, data.offset, buf) {
            Ok(()) => {
                direct.reads.fetch_add(1, Ordering::Relaxed);
                return check(dir, block, data, buf);
            }
            // This file system reads it only through the page cache.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => direct.refuse(data.segment),
            // Anything else is for the buffered read to report (or get past).
            Err(_) => {}
        }
    }
    let drop_behind = how.drop_behind;
    file.read_exact_at(buf, data.offset).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            StoreError::SegmentTruncated {
                path: path(),
                expected: data.offset + u64::from(data.len),
                actual: file.metadata().map(|m| m.len()).unwrap_or(0),
            }
        } else {
            StoreError::Io {
                op: "read segment",
                path: path(),
                source: e,
            }
        }
    })?;
    if drop_behind {
        // Best effort, it only affects caching. The range is widened to whole pages: the
        // kernel drops only pages wholly inside it, and a compressed payload shares its first
        // and last pages with its neighbours (clean pages; one read again is read from disk).
        let start = data.offset & !4095;
        let end = (data.offset + u64::from(data.len) + 4095) & !4095;
        // SAFETY: fadvise on an open descriptor of ours; it does not touch memory.
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                libc::off_t::try_from(start).unwrap_or(libc::off_t::MAX),
                libc::off_t::try_from(end - start).unwrap_or(0),
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }
    check(dir, block, data, buf)
}

/// Checks `buf`, the payload of `block` as read, against its checksum.
fn check(dir: &Path, block: u64, data: &DataRef, buf: &[u8]) -> Result<(), StoreError> {
    let computed = xxh3_64(buf);
    if computed != data.checksum {
        return Err(StoreError::Corrupt {
            block,
            path: dir.join(segment::file_name(data.segment)),
            offset: data.offset,
            len: data.len,
            stored: data.checksum,
            computed,
        });
    }
    Ok(())
}

/// Decodes `block`, whose slot is `slot`, into `out`.
pub(super) fn read_block(
    dir: &Path,
    block: u64,
    slot: Slot,
    out: &mut [u8],
    how: &ReadPath,
    file_of: &FileOf<'_>,
) -> Result<Option<BlockKind>, StoreError> {
    match slot {
        Slot::Absent | Slot::Zero => out.fill(0),
        Slot::Fill(byte) => out.fill(byte),
        Slot::Data(data) => READ_SCRATCH.with(|scratch| {
            let (decoder, buf) = &mut *scratch.borrow_mut();
            read_payload(dir, block, &data, buf, how, file_of)?;
            if how.sealed {
                let Some((key, store_id)) = &how.key else {
                    return Err(StoreError::Sealed {
                        dir: dir.to_path_buf(),
                    });
                };
                let aad = crate::seal::block_aad(store_id, block);
                let len = key.open(&aad, buf).map_err(|source| StoreError::Unsealed {
                    block,
                    path: dir.join(segment::file_name(data.segment)),
                    offset: data.offset,
                    source,
                })?;
                buf.truncate(len);
            }
            decoder
                .decode(data.kind, buf, out)
                .map_err(|source| StoreError::Decode {
                    block,
                    path: dir.join(segment::file_name(data.segment)),
                    offset: data.offset,
                    source,
                })
        })?,
    }
    Ok(slot.kind())
}

/// A read-only view of a store's image as it was when the view was taken, usable from any
/// thread while the store goes on being written (payloads are never overwritten in place, and
/// open segment files stay readable even after compaction unlinks them). Blocks written but
/// not committed when the view was taken must not be read after a rollback.
#[derive(Debug, Clone)]
pub struct StoreReader {
    pub(super) how: ReadPath,
    pub(super) meta: Arc<BTreeMap<String, Vec<u8>>>,
    pub(super) dir: PathBuf,
    pub(super) block_size: BlockSize,
    pub(super) image_size: u64,
    pub(super) slots: Arc<[Slot]>,
    pub(super) files: Arc<BTreeMap<u32, Arc<File>>>,
}

impl StoreReader {
    /// Bytes per block.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// Bytes in the image.
    pub fn image_size(&self) -> u64 {
        self.image_size
    }

    /// The metadata value of `key` as it was when the view was taken.
    pub fn meta(&self, key: &str) -> Option<&[u8]> {
        self.meta.get(key).map(Vec::as_slice)
    }

    /// The kind of `block` (`None`: absent, reads as zeros; also for an index past the end).
    pub fn kind(&self, block: u64) -> Option<BlockKind> {
        self.slots.get(block as usize).and_then(Slot::kind)
    }

    /// Reads `block` into `out` (exactly the block's length), as `DiskStore::get`.
    pub fn get(&self, block: u64, out: &mut [u8]) -> Result<Option<BlockKind>, StoreError> {
        let blocks = self.slots.len() as u64;
        let slot = *self
            .slots
            .get(block as usize)
            .ok_or(StoreError::BlockOutOfRange { block, blocks })?;
        let expected = self.block_size.len_in_image(block, self.image_size);
        if out.len() != expected {
            return Err(StoreError::WrongLength {
                block,
                expected,
                actual: out.len(),
            });
        }
        read_block(&self.dir, block, slot, out, &self.how, &|id| {
            self.files.get(&id).map(|f| f.as_ref())
        })
    }
}
