//! Page sources: where the bytes of non-resident pages come from. A source reads whole blocks
//! of the RAM image by offset; the pager decides which pages of a block to install.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use compressed_backing::codec::uniform_byte;
use compressed_backing::{BlockKind, DiskStore, StoreError};
use parking_lot::RwLock;

/// Failures to read a block.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The raw memory file could not be read.
    #[error("cannot read {len} bytes at offset {offset} of {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// Where.
        offset: u64,
        /// How much.
        len: usize,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The store failed (corrupt block, I/O error).
    #[error("cannot read block {block} from the store")]
    Store {
        /// The block.
        block: u64,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// No store is attached (nothing was offloaded).
    #[error("no offload store is attached")]
    NoStore,
    /// The memory pool could not give a block back.
    #[error("the memory pool cannot give block {block} back")]
    Pool {
        /// The block.
        block: u64,
        /// The pool's error.
        #[source]
        source: compressed_backing::PoolError,
    },
    /// A block whose pages are pooled is not in the memory pool: its bytes are gone.
    #[error("block {block} is pooled but not in the memory pool")]
    NotPooled {
        /// The block.
        block: u64,
    },
}

/// What a read produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// All zeros (the buffer was zero-filled): install the zero page, copy nothing.
    Zero,
    /// Data in the buffer.
    Data,
}

/// A source of page contents, addressed by offset in the RAM image. Called from several
/// threads at once.
pub trait PageSource: Send + Sync + fmt::Debug {
    /// Bytes in the image.
    fn image_size(&self) -> u64;

    /// Fills `buf` with the image's bytes at `offset` (block-aligned; `buf` is one block, or
    /// less at the end of the image). Bytes decompressed are added to `decompressed`.
    fn read(
        &self,
        offset: u64,
        buf: &mut [u8],
        decompressed: &mut u64,
    ) -> Result<Content, SourceError>;

    /// The block size this source is read best in, if it has one: a store's, whose every
    /// block is one payload (one read, one range request of an object store). A pager over
    /// it should use blocks at least this large, or one fault reads several payloads one
    /// after the other.
    fn block_size(&self) -> Option<compressed_backing::BlockSize> {
        None
    }

    /// The image's bytes at `offset..offset + len` (page-aligned) mapped into this process,
    /// if the source can give them without a copy (a raw file: a window of it is mapped for
    /// the caller and unmapped when the [`Mapped`] is dropped). They are for `UFFDIO_COPY`
    /// alone, whose read happens in the kernel: if the file was truncated since it was
    /// opened, the copy fails with `EFAULT`, where a read from this process would raise
    /// `SIGBUS`.
    fn mapped(&self, offset: u64, len: usize) -> Option<Mapped> {
        let _ = (offset, len);
        None
    }

    /// Whether [`PageSource::mapped`] gives windows: a block is then installed without being
    /// read first, and reading it ahead of the guest's faults gains nothing.
    fn maps(&self) -> bool {
        false
    }
}

/// The memory pool of cold compression, as the tier that holds `Pooled` pages: it reads whole
/// blocks, by the block of `offset`.
impl PageSource for compressed_backing::MemoryPool {
    fn image_size(&self) -> u64 {
        let config = self.config();
        config.blocks * config.block_size.bytes_u64()
    }

    fn read(
        &self,
        offset: u64,
        buf: &mut [u8],
        decompressed: &mut u64,
    ) -> Result<Content, SourceError> {
        let block = self.config().block_size.index_of(offset);
        match self.get(block, buf) {
            Ok(Some(BlockKind::Zero)) => Ok(Content::Zero),
            Ok(Some(kind)) => {
                if kind.is_compressed() {
                    *decompressed += buf.len() as u64;
                }
                Ok(Content::Data)
            }
            Ok(None) => Err(SourceError::NotPooled { block }),
            Err(source) => Err(SourceError::Pool { block, source }),
        }
    }
}

/// A raw memory file (e.g. a Firecracker snapshot's memory file).
#[derive(Debug)]
pub struct RawFileSource {
    path: PathBuf,
    file: File,
    size: u64,
}

/// A window of a file mapped read-only into this process for the kernel to read (see
/// [`PageSource::mapped`]); unmapped on drop.
#[derive(Debug)]
pub struct Mapped {
    ptr: *const u8,
    len: usize,
}

impl Mapped {
    /// Maps `len` bytes of `file` at `offset` (page-aligned), its page-cache pages mapped at
    /// once (`MAP_POPULATE`: one call instead of a fault per 64 KiB inside the copy).
    fn window(file: &File, offset: u64, len: usize) -> Option<Self> {
        use std::os::fd::AsRawFd;
        let at = libc::off_t::try_from(offset).ok()?;
        if len == 0 || !offset.is_multiple_of(crate::addr::PAGE_SIZE) {
            return None;
        }
        // SAFETY: a new read-only mapping the kernel places, of a file we hold open; the
        // result is checked. Only the kernel reads it (`UFFDIO_COPY`), and it answers an access
        // past a shrunken file's end with EFAULT, not a signal.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                at,
            )
        };
        (ptr != libc::MAP_FAILED).then(|| Self {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The bytes, for a `UFFDIO_COPY` source: never to be read from user space.
    pub fn for_kernel(&self) -> &[u8] {
        // SAFETY: the live mapping of `len` bytes; only the kernel reads through it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `window`, which nothing refers to any more.
        unsafe { libc::munmap(self.ptr.cast_mut().cast(), self.len) };
    }
}

impl RawFileSource {
    /// Opens `path` read-only. It must be a regular file: a symbolic link, a FIFO (whose
    /// reads would block every fault thread) or a device is refused.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        Self::from_file(path, compressed_backing::file::open_read(path)?)
    }
}

impl RawFileSource {
    /// A source over `file`, already opened (and checked) as `path`, which names it in errors.
    pub fn from_file(path: &Path, file: File) -> std::io::Result<Self> {
        let size = file.metadata()?.len();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            size,
        })
    }
}

impl PageSource for RawFileSource {
    fn image_size(&self) -> u64 {
        self.size
    }

    fn read(&self, offset: u64, buf: &mut [u8], _: &mut u64) -> Result<Content, SourceError> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|source| SourceError::File {
                path: self.path.clone(),
                offset,
                len: buf.len(),
                source,
            })?;
        Ok(if uniform_byte(buf) == Some(0) {
            Content::Zero
        } else {
            Content::Data
        })
    }

    fn mapped(&self, offset: u64, len: usize) -> Option<Mapped> {
        // Inside the file as it was opened; the kernel guards the rest.
        if offset.checked_add(len as u64)? > self.size {
            return None;
        }
        Mapped::window(&self.file, offset, len)
    }

    fn maps(&self) -> bool {
        true
    }
}

/// Reads the store's blocks from `first` on into `buf`, one after the other.
fn read_blocks(
    store: &DiskStore,
    first: u64,
    buf: &mut [u8],
    step: usize,
    decompressed: &mut u64,
) -> Result<Content, SourceError> {
    let mut content = Content::Zero;
    for (i, part) in buf.chunks_mut(step).enumerate() {
        let block = first + i as u64;
        let kind = store
            .get(block, part)
            .map_err(|source| SourceError::Store { block, source })?;
        match kind {
            None | Some(BlockKind::Zero) => part.fill(0),
            Some(kind) => {
                if kind.is_compressed() {
                    *decompressed += part.len() as u64;
                }
                content = Content::Data;
            }
        }
    }
    Ok(content)
}

/// A `DiskStore`, shared: faults read it while offload (with the VM paused) may write it.
#[derive(Debug, Clone, Default)]
pub struct StoreSource {
    store: Arc<RwLock<Option<DiskStore>>>,
}

impl StoreSource {
    /// A source over `store`.
    pub fn new(store: DiskStore) -> Self {
        Self {
            store: Arc::new(RwLock::new(Some(store))),
        }
    }

    /// A source with no store yet (one is attached at the first offload).
    pub fn empty() -> Self {
        Self::default()
    }

    /// The shared store slot.
    pub fn slot(&self) -> &Arc<RwLock<Option<DiskStore>>> {
        &self.store
    }
}

impl PageSource for StoreSource {
    fn image_size(&self) -> u64 {
        self.store.read().as_ref().map_or(0, DiskStore::image_size)
    }

    fn read(
        &self,
        offset: u64,
        buf: &mut [u8],
        decompressed: &mut u64,
    ) -> Result<Content, SourceError> {
        let guard = self.store.read();
        let store = guard.as_ref().ok_or(SourceError::NoStore)?;
        // A pager whose blocks are larger than the store's (huge pages served from a store of
        // 64 KiB blocks) reads several into its buffer, one after the other: the second core
        // is the pager's to use, reading ahead along the guest's stride (`pager/stride.rs`).
        let step = store.block_size().bytes();
        let first = store.block_size().index_of(offset);
        read_blocks(store, first, buf, step, decompressed)
    }

    fn block_size(&self) -> Option<compressed_backing::BlockSize> {
        self.store.read().as_ref().map(DiskStore::block_size)
    }
}
