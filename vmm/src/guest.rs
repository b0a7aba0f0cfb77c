//! The workload guest's side of the contract: its binary, the guest-physical layout, the
//! mailbox, opcodes and ports (mirroring guest/guest.c), and the digest and fill functions it
//! computes, so that the host can check its results.

/// The guest program, built from guest/guest.c by build.rs.
pub const BINARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/guest.bin"));

/// PML4 of the identity map.
pub const PML4_GPA: u64 = 0x1000;
/// PDPT (one entry per GiB).
pub const PDPT_GPA: u64 = 0x2000;
/// First page directory (one per GiB, consecutive).
pub const PD_GPA: u64 = 0x3000;
/// Most guest RAM the identity map covers (4 page directories).
pub const MAX_RAM: u64 = 4 << 30;
/// The command mailbox.
pub const MAILBOX_GPA: u64 = 0x8000;
/// The block request.
pub const BLK_GPA: u64 = 0x9000;
/// Where the program is loaded and starts.
pub const CODE_GPA: u64 = 0x10000;
/// Initial stack pointer (≡ 8 mod 16, as after a call).
pub const STACK_TOP: u64 = 0xF_FFF8;
/// Disk I/O bounce buffer.
pub const IO_BUF_GPA: u64 = 0x10_0000;
/// Its size.
pub const IO_BUF_SIZE: u64 = 0x10_0000;
/// Start of the application-data region (everything above the first 2 MiB).
pub const APP_BASE: u64 = 0x20_0000;
/// Smallest RAM that leaves room for some application data.
pub const MIN_RAM: u64 = 4 << 20;

/// Whether a VM can have `bytes` of guest RAM: between [`MIN_RAM`] and [`MAX_RAM`], in whole
/// 2 MiB pages (the identity map's).
pub fn check_memory(bytes: u64) -> Result<(), String> {
    if !(MIN_RAM..=MAX_RAM).contains(&bytes) {
        return Err(format!(
            "memory must be between {} MiB and {} GiB, not {bytes} bytes",
            MIN_RAM >> 20,
            MAX_RAM >> 30,
        ));
    }
    if !bytes.is_multiple_of(2 << 20) {
        return Err(format!(
            "memory must be a multiple of 2 MiB, not {bytes} bytes"
        ));
    }
    Ok(())
}

/// A command finished (or the guest started).
pub const PORT_DONE: u16 = 0x10;
/// The block request is ready.
pub const PORT_BLK: u16 = 0x20;
/// The range in the mailbox's free report is free.
pub const PORT_FREE: u16 = 0x30;
/// A model request (mailbox `arg[0]`) is out; the VMM answers in the I/O buffer
/// (`arg[1]` bytes, `arg[2]` nonzero on an error) before the guest goes on.
pub const PORT_MODEL: u16 = 0x40;

/// Most bytes of one block request: the guest's I/O buffer (what it transfers at a time).
pub const MAX_BLK_LEN: u64 = IO_BUF_SIZE;
/// Block requests address whole sectors: offsets and lengths are multiples of this.
pub const SECTOR: u64 = 512;
/// Largest virtual disk: no request reaches past it (the disk file is sparse; this bounds how
/// far a guest can make it extend).
pub const DISK_MAX: u64 = 64 << 30;
/// Longest timer the guest may report while it waits for the model, milliseconds (one hour):
/// far beyond any real timer, and well inside `Instant` arithmetic.
pub const MAX_TIMER_MS: u64 = 3_600_000;

/// Command opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Op {
    /// Fill application data: size, kind, seed.
    Fill = 1,
    /// Digest the first `size` bytes.
    Digest = 2,
    /// Read the first `size` bytes.
    Touch = 3,
    /// Rewrite a share of the filled pages: percent, seed.
    Rewrite = 4,
    /// Free the application data and report it.
    Release = 5,
    /// Digest, write to disk, flush, read back, verify.
    Task = 6,
    /// Ask the model (request id); digest the answer.
    Model = 7,
    /// Write a word (guest-physical address, value), then `out` to a port (0: none); results:
    /// the block request's status, the free report's, the model's error flag.
    Poke = 8,
    /// Random writes into the request areas and random port I/O (seed, count); results: outs
    /// sent, outs held back (they would have changed the guest's own pages or its data), ins.
    Chaos = 9,
    /// An arena (action 1 open, 2 close, 3 free; id; size; intent); results: its base and
    /// length, the host's errno on a refused report. Fill, touch and digest work on arena
    /// `arg[5] - 1` when `arg[5]` is not 0.
    Arena = 10,
    /// Ask the model (request id) and take its answer in batches as it streams in; digest
    /// the whole. Results: digest, bytes, timer runs, batches.
    ModelStream = 11,
    /// Download the URL in the I/O buffer (arg[0] bytes) into the application data, chunk by
    /// chunk over the net channel; results: digest of the bytes, bytes, chunks.
    Download = 12,
    /// Read the file of the VM's image at the path in the I/O buffer (arg[0] bytes) into the
    /// application data over the net channel; results as `Download`.
    Read = 13,
}

/// How `fill` writes data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[repr(u64)]
pub enum FillKind {
    /// A fixed 64-byte motif, repeated.
    Repeated = 0,
    /// Seeded pseudo-random bytes.
    Random = 1,
    /// Zeros.
    Zero = 2,
    /// Distinct pages that still compress: in every 64-byte line a random word and a counter,
    /// the rest the repeated motif.
    Distinct = 3,
}

/// Block request operations.
pub mod blk {
    /// Read into the guest buffer.
    pub const READ: u64 = 1;
    /// Write from the guest buffer.
    pub const WRITE: u64 = 2;
    /// Make written data durable.
    pub const FLUSH: u64 = 3;
}

/// Guest status codes.
pub mod status {
    /// Done.
    pub const OK: u64 = 0;
    /// Unknown opcode.
    pub const BAD_OP: u64 = 1;
    /// Size beyond the application-data region.
    pub const TOO_LARGE: u64 = 2;
    /// A disk request failed.
    pub const IO: u64 = 3;
    /// Data read back differs from what was written.
    pub const MISMATCH: u64 = 4;
    /// The model request got no answer (see the VMM's error).
    pub const MODEL: u64 = 5;
    /// The VMM refused the free report (see the VMM's error).
    pub const RELEASE: u64 = 6;
    /// An arena command failed: no such arena, no room for it, or the host refused its
    /// report (its errno in result 3).
    pub const ARENA: u64 = 7;
    /// A download failed (see the VMM's error; the host's errno in result 3).
    pub const NET: u64 = 8;
}

/// The mailbox page, as laid out by guest/guest.c.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct Mailbox {
    /// Opcode of the pending command.
    pub op: u64,
    /// Its arguments.
    pub arg: [u64; 6],
    /// Status of the last command.
    pub status: u64,
    /// Its results.
    pub result: [u64; 6],
    /// Application data start (set at boot).
    pub app_base: u64,
    /// Application data size (set at boot).
    pub app_size: u64,
    /// Bounce buffer (set at boot).
    pub io_buf: u64,
    /// Its size (set at boot).
    pub io_buf_size: u64,
    /// Free report: start.
    pub free_gpa: u64,
    /// Free report: length.
    pub free_len: u64,
    /// The VMM's answer to the free report: 0, or an errno.
    pub free_status: u64,
}

/// The block request, as laid out by guest/guest.c.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct BlkRequest {
    /// `blk::*`.
    pub op: u64,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Guest buffer.
    pub buf_gpa: u64,
    /// 0, or an errno.
    pub status: u64,
}

/// What a block request asks for, once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockIo {
    /// Read `len` bytes at disk offset `offset` into guest-physical `buf`.
    Read {
        /// Disk offset.
        offset: u64,
        /// Bytes (at most [`MAX_BLK_LEN`]).
        len: usize,
        /// Guest buffer, `len` bytes inside RAM.
        buf: u64,
    },
    /// Write `len` bytes from guest-physical `buf` at disk offset `offset`.
    Write {
        /// Disk offset.
        offset: u64,
        /// Bytes (at most [`MAX_BLK_LEN`]).
        len: usize,
        /// Guest buffer, `len` bytes inside RAM.
        buf: u64,
    },
    /// Make written data durable.
    Flush,
}

/// A guest request the VMM refuses: the errno the guest gets back, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// What the guest's status field gets.
    pub errno: i32,
    /// For the command's error.
    pub reason: String,
}

fn refuse(errno: i32, reason: String) -> Refused {
    Refused { errno, reason }
}

/// Checks a block request read from guest memory (every field is the guest's) for a VM of
/// `ram_size` bytes: a known op; whole sectors, at most [`MAX_BLK_LEN`] bytes, not past
/// [`DISK_MAX`]; a buffer inside RAM. All sums are checked.
pub fn check_block(request: &BlkRequest, ram_size: u64) -> Result<BlockIo, Refused> {
    let BlkRequest {
        op,
        offset,
        len,
        buf_gpa: buf,
        ..
    } = *request;
    if op == blk::FLUSH {
        return Ok(BlockIo::Flush);
    }
    if op != blk::READ && op != blk::WRITE {
        return Err(refuse(libc::EINVAL, format!("unknown block op {op}")));
    }
    if len > MAX_BLK_LEN || !len.is_multiple_of(SECTOR) || !offset.is_multiple_of(SECTOR) {
        return Err(refuse(
            libc::EINVAL,
            format!(
                "block request of {len} bytes at offset {offset}: whole {SECTOR}-byte sectors, \
                 at most {MAX_BLK_LEN} bytes"
            ),
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > DISK_MAX) {
        return Err(refuse(
            libc::EFBIG,
            format!("block request of {len} bytes at offset {offset} is past the disk's {DISK_MAX} bytes"),
        ));
    }
    if buf.checked_add(len).is_none_or(|end| end > ram_size) {
        return Err(refuse(
            libc::EFAULT,
            format!("block buffer of {len} bytes at {buf:#x} is outside RAM"),
        ));
    }
    let len = usize::try_from(len).expect("at most MAX_BLK_LEN");
    Ok(if op == blk::READ {
        BlockIo::Read { offset, len, buf }
    } else {
        BlockIo::Write { offset, len, buf }
    })
}

/// Checks a free-page report (the guest's `free_gpa`, `free_len`) for a VM of `ram_size`
/// bytes: whole 4 KiB pages of the application data, not empty, sums checked.
pub fn check_free(gpa: u64, len: u64, ram_size: u64) -> Result<(), Refused> {
    use basics::PAGE_SIZE as PAGE;
    let inside = gpa >= APP_BASE && gpa.checked_add(len).is_some_and(|end| end <= ram_size);
    if len == 0 || !gpa.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || !inside {
        return Err(refuse(
            libc::EINVAL,
            format!(
                "free report of {len} bytes at {gpa:#x}: whole pages of the application data \
                 ({APP_BASE:#x} to {ram_size:#x}) only"
            ),
        ));
    }
    Ok(())
}

const K1: u64 = 0x9E37_79B1_85EB_CA87;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// [`digest`] as command results print it (16 hex digits).
pub fn digest_hex(bytes: &[u8]) -> String {
    format!("{:016x}", digest(bytes))
}

/// The guest's digest of `bytes` (a multiple of 8): four interleaved multiply-rotate lanes
/// over little-endian words, folded with the length.
pub fn digest(bytes: &[u8]) -> u64 {
    let words: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
        .collect();
    let mix = |h: u64, w: u64| (h ^ w.wrapping_mul(K1)).rotate_left(31).wrapping_mul(K2);
    let (mut h0, mut h1, mut h2, mut h3) = (1u64, 2u64, 3u64, 4u64);
    let mut i = 0;
    while i + 4 <= words.len() {
        h0 = mix(h0, words[i]);
        h1 = mix(h1, words[i + 1]);
        h2 = mix(h2, words[i + 2]);
        h3 = mix(h3, words[i + 3]);
        i += 4;
    }
    while i < words.len() {
        h0 = mix(h0, words[i]);
        i += 1;
    }
    let mut h = h0
        .rotate_left(1)
        .wrapping_add(h1.rotate_left(7))
        .wrapping_add(h2.rotate_left(12))
        .wrapping_add(h3.rotate_left(18));
    h ^= (bytes.len() as u64).wrapping_mul(K1);
    h ^= h >> 33;
    h = h.wrapping_mul(K2);
    h ^= h >> 29;
    h
}

const MOTIF: [u64; 8] = [
    0x5A7F_2A3C_1E0D_4B69,
    0x0123_4567_89AB_CDEF,
    0xF0E1_D2C3_B4A5_9687,
    0x1122_3344_5566_7788,
    0x8899_AABB_CCDD_EEFF,
    0x0F1E_2D3C_4B5A_6978,
    0xDEAD_BEEF_CAFE_F00D,
    0x6A09_E667_F3BC_C908,
];

fn seed_state(seed: u64, salt: u64) -> u64 {
    let s = seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt;
    if s == 0 {
        1
    } else {
        s
    }
}

/// The guest's generator (xorshift64*): the next word of `state`'s sequence.
fn xorshift_star(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// What the guest's `rewrite PERCENT seed=SEED` does to `bytes` (the filled application
/// data): the pages it picks get new random bytes. Returns how many it rewrote.
pub fn rewrite_bytes(bytes: &mut [u8], percent: u64, seed: u64) -> u64 {
    const PICK: u64 = 0xD6E8_FEB8_6659_FD93;
    let mut count = 0;
    for (page, chunk) in bytes
        .chunks_exact_mut(basics::PageSize::BASE.usize())
        .enumerate()
    {
        let page = page as u64;
        let mut pick = seed_state(seed, page.wrapping_mul(PICK));
        pick ^= pick >> 32;
        pick = pick.wrapping_mul(PICK);
        pick ^= pick >> 32;
        if pick % 100 >= percent {
            continue;
        }
        let mut state = seed_state(seed ^ 0xA5A5_A5A5, page);
        for word in chunk.chunks_exact_mut(8) {
            word.copy_from_slice(&xorshift_star(&mut state).to_le_bytes());
        }
        count += 1;
    }
    count
}

/// The bytes the guest's `fill SIZE KIND seed=SEED` writes.
pub fn fill_bytes(size: u64, kind: FillKind, seed: u64) -> Vec<u8> {
    let words = size / 8;
    let mut out = Vec::with_capacity(size as usize);
    let mut state = seed_state(seed, 0);
    for i in 0..words {
        let word = match kind {
            FillKind::Repeated => MOTIF[(i & 7) as usize],
            FillKind::Random => xorshift_star(&mut state),
            FillKind::Zero => 0,
            FillKind::Distinct => match i & 7 {
                0 => xorshift_star(&mut state),
                1 => i,
                _ => MOTIF[(i & 7) as usize],
            },
        };
        out.extend_from_slice(&word.to_le_bytes());
    }
    out.resize(size as usize, 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mailbox_layout_matches_the_guest() {
        assert_eq!(std::mem::size_of::<Mailbox>(), 168);
        assert_eq!(std::mem::offset_of!(Mailbox, status), 56);
        assert_eq!(std::mem::offset_of!(Mailbox, app_base), 112);
        assert_eq!(std::mem::offset_of!(Mailbox, free_len), 152);
        assert_eq!(std::mem::offset_of!(Mailbox, free_status), 160);
        assert_eq!(std::mem::size_of::<BlkRequest>(), 40);
    }

    fn request(op: u64, offset: u64, len: u64, buf_gpa: u64) -> BlkRequest {
        BlkRequest {
            op,
            offset,
            len,
            buf_gpa,
            status: 0,
        }
    }

    #[test]
    fn check_block_refuses_what_the_disk_or_ram_cannot_serve() {
        const RAM: u64 = 64 << 20;
        assert_eq!(
            check_block(&request(blk::READ, 4096, 8192, IO_BUF_GPA), RAM),
            Ok(BlockIo::Read {
                offset: 4096,
                len: 8192,
                buf: IO_BUF_GPA
            })
        );
        assert_eq!(
            check_block(&request(blk::FLUSH, u64::MAX, u64::MAX, u64::MAX), RAM),
            Ok(BlockIo::Flush)
        );
        for (req, errno) in [
            (request(0, 0, 512, IO_BUF_GPA), libc::EINVAL),
            (
                request(blk::READ, 0, MAX_BLK_LEN + 512, IO_BUF_GPA),
                libc::EINVAL,
            ),
            (request(blk::READ, 0, 100, IO_BUF_GPA), libc::EINVAL),
            (request(blk::WRITE, 7, 512, IO_BUF_GPA), libc::EINVAL),
            (request(blk::WRITE, DISK_MAX, 512, IO_BUF_GPA), libc::EFBIG),
            (
                request(blk::WRITE, u64::MAX - 511, 512, IO_BUF_GPA),
                libc::EFBIG,
            ),
            (request(blk::READ, 0, 4096, RAM - 2048), libc::EFAULT),
            (request(blk::READ, 0, 4096, u64::MAX - 1024), libc::EFAULT),
        ] {
            assert_eq!(
                check_block(&req, RAM).map_err(|r| r.errno),
                Err(errno),
                "{req:?}"
            );
        }
    }

    #[test]
    fn check_free_takes_whole_pages_of_the_application_data_only() {
        const RAM: u64 = 64 << 20;
        assert_eq!(check_free(APP_BASE, RAM - APP_BASE, RAM), Ok(()));
        for (gpa, len) in [
            (APP_BASE, 0),
            (0, 4096),
            (IO_BUF_GPA, 4096),
            (APP_BASE + 1, 4096),
            (APP_BASE, 4095),
            (RAM - 4096, 8192),
            (u64::MAX - 4095, 8192),
            (APP_BASE, u64::MAX - 4095),
        ] {
            assert!(check_free(gpa, len, RAM).is_err(), "{gpa:#x} {len:#x}");
        }
    }

    proptest::proptest! {
        /// Whatever the guest writes, what the checks let through stays inside RAM, the disk
        /// and one I/O buffer.
        #[test]
        fn fuzz_guest_requests_accepted_stay_inside_ram_and_the_disk(
            op in 0u64..5,
            offset in proptest::prelude::any::<u64>(),
            len in proptest::prelude::any::<u64>(),
            gpa in proptest::prelude::any::<u64>(),
            small in proptest::prelude::any::<bool>(),
            pages in 2u64..2048,
        ) {
            let ram = pages * (2 << 20);
            // Half the cases in the interesting range: near RAM and the buffer size.
            let (offset, len, gpa) = if small {
                (offset % (2 * DISK_MAX), len % (2 * MAX_BLK_LEN), gpa % (2 * ram))
            } else {
                (offset, len, gpa)
            };
            match check_block(&request(op, offset, len, gpa), ram) {
                Ok(BlockIo::Read { offset, len, buf } | BlockIo::Write { offset, len, buf }) => {
                    let len = len as u64;
                    proptest::prop_assert!(len <= MAX_BLK_LEN);
                    proptest::prop_assert!(u128::from(buf) + u128::from(len) <= u128::from(ram));
                    proptest::prop_assert!(u128::from(offset) + u128::from(len) <= u128::from(DISK_MAX));
                    proptest::prop_assert!(offset.is_multiple_of(SECTOR) && len.is_multiple_of(SECTOR));
                }
                Ok(BlockIo::Flush) => proptest::prop_assert_eq!(op, blk::FLUSH),
                Err(refused) => proptest::prop_assert!(refused.errno > 0),
            }
            if check_free(gpa, len, ram).is_ok() {
                proptest::prop_assert!(gpa >= APP_BASE && len > 0);
                proptest::prop_assert!(u128::from(gpa) + u128::from(len) <= u128::from(ram));
            }
        }
    }

    #[test]
    fn guest_binary_is_small_and_fits_below_the_stack() {
        assert!(!BINARY.is_empty());
        assert!(
            CODE_GPA + (BINARY.len() as u64) < 0x8_0000,
            "{}",
            BINARY.len()
        );
    }

    #[test]
    fn rewrite_changes_about_the_share_of_pages_asked() {
        let mut bytes = fill_bytes(4 << 20, FillKind::Repeated, 0);
        let pages = rewrite_bytes(&mut bytes, 25, 3);
        assert!((200..=320).contains(&pages), "{pages} of 1024 pages");
        assert_ne!(bytes, fill_bytes(4 << 20, FillKind::Repeated, 0));
        let mut again = fill_bytes(4 << 20, FillKind::Repeated, 0);
        rewrite_bytes(&mut again, 25, 3);
        assert_eq!(bytes, again);
    }

    #[test]
    fn digest_depends_on_every_word_and_the_length() {
        let a = fill_bytes(4096, FillKind::Random, 1);
        let mut b = a.clone();
        b[4000] ^= 1;
        assert_ne!(digest(&a), digest(&b));
        assert_ne!(digest(&a[..4088]), digest(&a));
        assert_eq!(digest(&a), digest(&a.clone()));
        assert_ne!(digest(&[0u8; 64]), digest(&[0u8; 72]));
    }
}
