/*
 * The workload guest: a tiny x86-64 program that the VMM starts directly in 64-bit mode at
 * CPL3 (identity-mapped 2 MiB user pages, IOPL=3). It has no kernel and no interrupts: it
 * waits for a command in the mailbox page, runs it over the application-data region, writes
 * the result back and tells the VMM with `out`. Everything else (script parsing, sleeping,
 * idling) is done by the VMM between commands; the one timer it keeps (while it waits for a
 * model answer) is fired by the VMM returning from the model port.
 *
 * The mailbox layout, opcodes and ports are mirrored in vmm/src/guest.rs.
 *
 * `poke` and `chaos` play a hostile guest: they write what they like into the request areas
 * and knock on the VMM's ports, which must answer with an error status, never trust them.
 */
#include <stdint.h>

#define MAILBOX_GPA 0x8000ull
#define BLK_GPA 0x9000ull

#define PORT_DONE 0x10   /* a command finished (or the guest started); next, please */
#define PORT_BLK 0x20    /* the block request at BLK_GPA is ready */
#define PORT_FREE 0x30   /* the range in the mailbox's report fields is free */
#define PORT_MODEL 0x40  /* model request arg[0] is out; the answer is in io_buf when it returns */
#define PORT_PANIC 0x3f  /* something impossible happened; see status */
#define PORT_ARENA 0x50  /* outl: the page number of an arena report (struct arena_report) */
#define PORT_NET 0x60    /* outl: the page number of a net request (struct net_request) */

/* Downloads: the guest asks the host to GET a URL and takes the body chunk by chunk, each
 * written by the host into the buffer the request names; the host answers in the request's
 * own fields. The same message a Linux guest's driver would send (vmm/src/net.rs,
 * docs/waits.md). */
#define NET_GPA 0xB000ull
#define NET_MAGIC 0x544E5650u /* "PVNT" */
#define NET_VERSION 1
enum net_kind { NET_GET = 1, NET_NEXT = 2, NET_CLOSE = 3, NET_READ = 4 };

/* Arenas (Tide): memory a phase owns, in 2 MiB-aligned extents of its own at the top of the
 * application region, never shared with the application data below. The guest tells the host
 * when an arena opens (its extents and intent), closes (the phase is over: `discard` means
 * its contents are dead, `survive` that they must come back intact) and is freed. The report
 * is the versioned message a Linux guest's driver sends too (vmm/src/arena.rs). */
#define ARENA_GPA 0xA000ull
#define ARENA_MAGIC 0x52415650u /* "PVAR" */
#define ARENA_VERSION 1
#define ARENA_MAX 16
#define ARENA_MAX_EXTENTS 16
#define EXTENT 0x200000ull
enum arena_kind { AR_OPEN = 1, AR_CLOSE = 2, AR_FREE = 3, AR_IDLE = 4 };
enum arena_intent { AR_SURVIVE = 1, AR_DISCARD = 2 };

enum op { OP_NONE = 0, OP_FILL = 1, OP_DIGEST = 2, OP_TOUCH = 3, OP_REWRITE = 4,
          OP_RELEASE = 5, OP_TASK = 6, OP_MODEL = 7, OP_POKE = 8, OP_CHAOS = 9,
          OP_ARENA = 10, OP_MODEL_STREAM = 11, OP_DOWNLOAD = 12, OP_READ = 13 };
enum fill { FILL_REPEATED = 0, FILL_RANDOM = 1, FILL_ZERO = 2, FILL_DISTINCT = 3 };
enum blk_op { BLK_READ = 1, BLK_WRITE = 2, BLK_FLUSH = 3 };
enum status { ST_OK = 0, ST_BAD_OP = 1, ST_TOO_LARGE = 2, ST_IO = 3, ST_MISMATCH = 4,
              ST_MODEL = 5, ST_RELEASE = 6, ST_ARENA = 7, ST_NET = 8 };

struct mailbox {
    volatile uint64_t op;
    volatile uint64_t arg[6];
    volatile uint64_t status;
    volatile uint64_t result[6];
    /* Set by the VMM at boot. */
    volatile uint64_t app_base;
    volatile uint64_t app_size;
    volatile uint64_t io_buf;
    volatile uint64_t io_buf_size;
    /* The guest's free-page report for PORT_FREE. */
    volatile uint64_t free_gpa;
    volatile uint64_t free_len;
    /* The VMM's answer to it: 0, or an errno (the report was refused). */
    volatile uint64_t free_status;
};

struct blk_request {
    volatile uint64_t op;
    volatile uint64_t offset;   /* bytes into the disk */
    volatile uint64_t len;      /* bytes */
    volatile uint64_t buf_gpa;  /* guest buffer */
    volatile uint64_t status;   /* 0 ok, else an errno */
};

struct arena_report {
    volatile uint32_t magic;
    volatile uint16_t version;
    volatile uint16_t kind;     /* enum arena_kind */
    volatile uint64_t id;
    volatile uint64_t intent;   /* enum arena_intent */
    volatile uint64_t count;    /* extents that follow */
    volatile uint64_t status;   /* the host's answer: 0, or an errno */
    struct { volatile uint64_t gpa, len; } extent[ARENA_MAX_EXTENTS];
};

struct net_request {
    volatile uint32_t magic;
    volatile uint16_t version;
    volatile uint16_t kind;     /* enum net_kind */
    volatile uint64_t id;       /* the guest's name for the transfer */
    volatile uint64_t buf_gpa;  /* where the host writes a chunk */
    volatile uint64_t buf_len;  /* room there (at NET_GET: for the whole body) */
    volatile uint64_t url_gpa;  /* NET_GET: the URL */
    volatile uint64_t url_len;
    volatile uint64_t status;   /* the host's answer: 0, or an errno */
    volatile uint64_t len;      /* bytes written at buf_gpa */
    volatile uint64_t more;     /* 1 while more chunks follow */
    volatile uint64_t total;    /* the length announced, or ~0 */
};

#define MB ((struct mailbox *)MAILBOX_GPA)
#define NET ((struct net_request *)NET_GPA)
#define AR ((struct arena_report *)ARENA_GPA)
#define BLK ((struct blk_request *)BLK_GPA)

static inline void out(uint16_t port) {
    __asm__ volatile("outb %%al, %w0" : : "Nd"(port), "a"(0) : "memory");
}

static inline void outl(uint16_t port, uint32_t value) {
    __asm__ volatile("outl %%eax, %w0" : : "Nd"(port), "a"(value) : "memory");
}

static inline uint8_t in(uint16_t port) {
    uint8_t value;
    __asm__ volatile("inb %w1, %%al" : "=a"(value) : "Nd"(port) : "memory");
    return value;
}

static uint64_t filled;          /* bytes of app data written so far */
static volatile uint64_t heartbeat; /* what the model-wait timer's work leaves behind */

/* The guest's arenas: one run of whole extents each, below the top of the application
 * region. `filled` is what `fill arena=ID` wrote. */
struct arena { uint64_t id, base, len, intent, filled, state; };
enum arena_state { A_FREE = 0, A_OPEN = 1, A_CLOSED = 2 };
static struct arena arenas[ARENA_MAX];
/* Arenas freed since the last `release`: free memory its report gives back too (on a host that
 * ignores arena reports, that is the only way it goes). An arena opened over one takes out the
 * part it covers; adjacent ones merge. Room for twice as many runs as arenas can be open. */
#define UNREPORTED_MAX (2 * ARENA_MAX)
static struct { uint64_t base, len; } unreported[UNREPORTED_MAX];

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The same digest as vmm/src/guest.rs `digest`: four interleaved lanes of a multiply-rotate
 * mix over little-endian u64 words, then folded with the length. */
static uint64_t digest(const uint64_t *p, uint64_t bytes) {
    const uint64_t k1 = 0x9E3779B185EBCA87ull, k2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t h0 = 1, h1 = 2, h2 = 3, h3 = 4;
    uint64_t words = bytes / 8, i = 0;
    for (; i + 4 <= words; i += 4) {
        h0 = rotl(h0 ^ (p[i] * k1), 31) * k2;
        h1 = rotl(h1 ^ (p[i + 1] * k1), 31) * k2;
        h2 = rotl(h2 ^ (p[i + 2] * k1), 31) * k2;
        h3 = rotl(h3 ^ (p[i + 3] * k1), 31) * k2;
    }
    for (; i < words; i++) h0 = rotl(h0 ^ (p[i] * k1), 31) * k2;
    uint64_t h = rotl(h0, 1) + rotl(h1, 7) + rotl(h2, 12) + rotl(h3, 18);
    h ^= bytes * k1;
    h ^= h >> 33; h *= k2; h ^= h >> 29;
    return h;
}

/* xorshift64*: the same generator as vmm/src/guest.rs. */
static inline uint64_t next_random(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static inline uint64_t seed_state(uint64_t seed, uint64_t salt) {
    uint64_t s = (seed + 1) * 0x9E3779B97F4A7C15ull ^ salt;
    return s ? s : 1;
}

/* The repeated pattern: a fixed 64-byte motif (eight words). */
static const uint64_t motif[8] = {
    0x5A7F2A3C1E0D4B69ull, 0x0123456789ABCDEFull, 0xF0E1D2C3B4A59687ull, 0x1122334455667788ull,
    0x8899AABBCCDDEEFFull, 0x0F1E2D3C4B5A6978ull, 0xDEADBEEFCAFEF00Dull, 0x6A09E667F3BCC908ull,
};

static void fill_page(uint64_t *p, uint64_t words, uint64_t kind, uint64_t *state) {
    uint64_t i;
    switch (kind) {
    case FILL_DISTINCT:
        /* Every 64-byte line differs (a counter and one random word), the rest repeats: no two
         * pages are alike, yet each compresses well. */
        for (i = 0; i < words; i++)
            p[i] = (i & 7) == 0 ? next_random(state) : (i & 7) == 1 ? i : motif[i & 7];
        break;
    case FILL_REPEATED:
        for (i = 0; i < words; i++) p[i] = motif[i & 7];
        break;
    case FILL_RANDOM:
        for (i = 0; i < words; i++) p[i] = next_random(state);
        break;
    default:
        for (i = 0; i < words; i++) p[i] = 0;
        break;
    }
}

/* The application data may grow up to the lowest arena. */
static uint64_t app_limit(void) {
    uint64_t limit = MB->app_base + MB->app_size;
    for (int i = 0; i < ARENA_MAX; i++)
        if (arenas[i].state != A_FREE && arenas[i].base < limit) limit = arenas[i].base;
    return limit - MB->app_base;
}

static struct arena *arena_of(uint64_t id) {
    for (int i = 0; i < ARENA_MAX; i++)
        if (arenas[i].state != A_FREE && arenas[i].id == id) return &arenas[i];
    return 0;
}

/* Where a command works: the application data, or (selector = ID + 1) an arena. */
static uint64_t target(uint64_t selector, uint64_t *base, uint64_t *size, uint64_t **filled_of) {
    if (!selector) {
        *base = MB->app_base;
        *size = app_limit();
        *filled_of = &filled;
        return ST_OK;
    }
    struct arena *a = arena_of(selector - 1);
    if (!a) return ST_ARENA;
    *base = a->base;
    *size = a->len;
    *filled_of = &a->filled;
    return ST_OK;
}

static uint64_t op_fill(uint64_t bytes, uint64_t kind, uint64_t seed, uint64_t selector) {
    uint64_t base, size, *done;
    if (target(selector, &base, &size, &done)) return ST_ARENA;
    if (bytes > size) return ST_TOO_LARGE;
    uint64_t state = seed_state(seed, 0);
    fill_page((uint64_t *)base, bytes / 8, kind, &state);
    *done = bytes;
    return ST_OK;
}

/* `download URL` (kind NET_GET) and `read PATH` (NET_READ, a file of the VM's image): the
 * URL or path (arg[0] bytes in io_buf) fetched by the host into the application data from its
 * start, chunk by chunk (it replaces the data, as `fill` does). The guest sleeps at the port
 * between chunks; the host may take its memory meanwhile. Results: bytes, chunks, the host's
 * errno on a failure. */
static uint64_t downloads;

static uint64_t op_download(uint16_t kind, uint64_t url_len, uint64_t *got, uint64_t *chunks,
                            uint64_t *err) {
    uint64_t base, size, *done;
    target(0, &base, &size, &done);
    NET->magic = NET_MAGIC;
    NET->version = NET_VERSION;
    NET->kind = kind;
    NET->id = ++downloads;
    NET->url_gpa = MB->io_buf;
    NET->url_len = url_len;
    *got = *chunks = *err = 0;
    for (;;) {
        NET->buf_gpa = base + *got;
        NET->buf_len = size - *got;
        NET->status = ~0ull; /* a request the host does not answer reads as failed */
        if (!NET->buf_len) {
            NET->kind = NET_CLOSE;
            outl(PORT_NET, (uint32_t)(NET_GPA >> 12));
            return ST_TOO_LARGE;
        }
        outl(PORT_NET, (uint32_t)(NET_GPA >> 12));
        if (NET->status) { *err = NET->status; return ST_NET; }
        if (NET->len > NET->buf_len) { *err = ~0ull; return ST_NET; }
        *got += NET->len;
        if (NET->len) (*chunks)++;
        if (!NET->more) break;
        NET->kind = NET_NEXT;
    }
    *done = *got;
    return ST_OK;
}

/* Sends the report in AR (its fields but the status set) and returns the host's answer. */
static uint64_t arena_send(void) {
    AR->magic = ARENA_MAGIC;
    AR->version = ARENA_VERSION;
    AR->status = ~0ull; /* a report the host does not answer reads as refused */
    outl(PORT_ARENA, (uint32_t)(ARENA_GPA >> 12));
    return AR->status;
}

static void arena_describe(const struct arena *a, uint16_t kind) {
    AR->kind = kind;
    AR->id = a->id;
    AR->intent = a->intent;
    AR->count = 1;
    AR->extent[0].gpa = a->base;
    AR->extent[0].len = a->len;
}

/* A freed run joins the unreported ones, merged with its neighbours. (Runs are disjoint: each
 * was an arena's, and an arena opened over one took its part out.) */
static void unreported_add(uint64_t base, uint64_t len) {
    for (int i = 0; i < UNREPORTED_MAX; i++) {
        if (!unreported[i].len) continue;
        if (unreported[i].base + unreported[i].len == base) {
            base = unreported[i].base;
            len += unreported[i].len;
            unreported[i].len = 0;
        } else if (base + len == unreported[i].base) {
            len += unreported[i].len;
            unreported[i].len = 0;
        }
    }
    for (int i = 0; i < UNREPORTED_MAX; i++)
        if (!unreported[i].len) {
            unreported[i].base = base;
            unreported[i].len = len;
            return;
        }
    /* No room (twice as many runs as arenas, none adjacent: rare): the run stays unreported,
     * which costs memory until the host acts on arenas, never data. */
}

/* An arena opens over [base, base + len): the parts of unreported runs it covers are in use. */
static void unreported_take(uint64_t base, uint64_t len) {
    uint64_t end = base + len;
    for (int i = 0; i < UNREPORTED_MAX; i++) {
        uint64_t b = unreported[i].base, e = b + unreported[i].len;
        if (!unreported[i].len || e <= base || end <= b) continue;
        unreported[i].len = 0;
        if (b < base) unreported_add(b, base - b);
        if (end < e) unreported_add(end, e - end);
    }
}

/* `arena open|close|free ID [SIZE INTENT]`. Open takes the highest run of free extents
 * above the application data; results: its base and length, the host's errno on refusal. */
static uint64_t op_arena(uint64_t action, uint64_t id, uint64_t bytes, uint64_t intent) {
    MB->result[3] = 0;
    struct arena *a = arena_of(id);
    if (action == AR_OPEN) {
        if (a || !bytes || (intent != AR_SURVIVE && intent != AR_DISCARD)) return ST_ARENA;
        struct arena *slot = 0;
        for (int i = 0; i < ARENA_MAX && !slot; i++)
            if (arenas[i].state == A_FREE) slot = &arenas[i];
        if (!slot) return ST_ARENA;
        uint64_t len = (bytes + EXTENT - 1) & ~(EXTENT - 1);
        uint64_t floor = (MB->app_base + filled + EXTENT - 1) & ~(EXTENT - 1);
        uint64_t end = (MB->app_base + MB->app_size) & ~(EXTENT - 1);
        for (;;) {
            if (end < floor + len) return ST_TOO_LARGE;
            uint64_t start = end - len, lowest = end;
            for (int i = 0; i < ARENA_MAX; i++) {
                const struct arena *o = &arenas[i];
                if (o->state != A_FREE && o->base < end && start < o->base + o->len && o->base < lowest)
                    lowest = o->base;
            }
            if (lowest == end) { end = start; break; }
            end = lowest;
        }
        struct arena fresh = { id, end, len, intent, 0, A_OPEN };
        arena_describe(&fresh, AR_OPEN);
        uint64_t st = arena_send();
        if (st) { MB->result[3] = st; return ST_ARENA; }
        *slot = fresh;
        unreported_take(fresh.base, fresh.len);
        MB->result[0] = fresh.base;
        MB->result[1] = fresh.len;
        return ST_OK;
    }
    if (!a || (action != AR_CLOSE && action != AR_FREE)) return ST_ARENA;
    if (action == AR_CLOSE && a->state != A_OPEN) return ST_ARENA;
    arena_describe(a, (uint16_t)action);
    uint64_t st = arena_send();
    MB->result[0] = a->base;
    MB->result[1] = a->len;
    if (st) { MB->result[3] = st; return ST_ARENA; }
    if (action == AR_CLOSE) {
        a->state = A_CLOSED;
        return ST_OK;
    }
    a->state = A_FREE;
    unreported_add(a->base, a->len);
    return ST_OK;
}

static uint64_t op_touch(uint64_t bytes, uint64_t selector, uint64_t *sum) {
    uint64_t base, size, *done;
    if (target(selector, &base, &size, &done)) return ST_ARENA;
    if (bytes > size) return ST_TOO_LARGE;
    const volatile uint64_t *p = (const volatile uint64_t *)base;
    uint64_t acc = 0;
    for (uint64_t i = 0; i < bytes / 8; i++) acc += p[i];
    *sum = acc;
    return ST_OK;
}

/* Overwrites `percent` of the filled pages (chosen by a hash of page index and seed) with
 * seeded random bytes; returns how many pages it rewrote. */
static uint64_t op_rewrite(uint64_t percent, uint64_t seed, uint64_t *pages) {
    uint64_t count = 0, total = filled / 4096;
    for (uint64_t page = 0; page < total; page++) {
        uint64_t pick = seed_state(seed, page * 0xD6E8FEB86659FD93ull);
        pick ^= pick >> 32; pick *= 0xD6E8FEB86659FD93ull; pick ^= pick >> 32;
        if (pick % 100 >= percent) continue;
        uint64_t state = seed_state(seed ^ 0xA5A5A5A5ull, page);
        fill_page((uint64_t *)(MB->app_base + page * 4096), 512, FILL_RANDOM, &state);
        count++;
    }
    *pages = count;
    return ST_OK;
}

static uint64_t blk(uint64_t op, uint64_t offset, uint64_t len, uint64_t buf) {
    BLK->op = op; BLK->offset = offset; BLK->len = len; BLK->buf_gpa = buf; BLK->status = 0;
    out(PORT_BLK);
    return BLK->status;
}

/* The seed's test task: digest the app data, write it to the disk, flush, read it back and
 * verify it against the data. Results: digest, bytes written. */
static uint64_t op_task(uint64_t *digest_out) {
    uint64_t bytes = filled, chunk = MB->io_buf_size;
    *digest_out = digest((const uint64_t *)MB->app_base, bytes);
    for (uint64_t off = 0; off < bytes; off += chunk) {
        uint64_t n = bytes - off < chunk ? bytes - off : chunk;
        if (blk(BLK_WRITE, off, n, MB->app_base + off)) return ST_IO;
    }
    if (blk(BLK_FLUSH, 0, 0, 0)) return ST_IO;
    for (uint64_t off = 0; off < bytes; off += chunk) {
        uint64_t n = bytes - off < chunk ? bytes - off : chunk;
        if (blk(BLK_READ, off, n, MB->io_buf)) return ST_IO;
        const uint64_t *a = (const uint64_t *)(MB->app_base + off);
        const uint64_t *b = (const uint64_t *)MB->io_buf;
        for (uint64_t i = 0; i < n / 8; i++)
            if (a[i] != b[i]) return ST_MISMATCH;
    }
    return ST_OK;
}

/* A value for a request field, as a hostile guest would pick it: anything, small, around the
 * end of RAM, near wrap-around, a power of two, inside the I/O buffer or the free application
 * memory above the filled data. */
static uint64_t chaos_value(uint64_t *s, uint64_t ram, uint64_t spare) {
    uint64_t pick = next_random(s) % 12, x = next_random(s);
    switch (pick) {
    case 0: return x;
    case 1: return x & 0xFFF;
    case 2: return x & 0x1FFFFF;
    case 3: return ram - (x & 0xFFFF);
    case 4: return ram + (x & 0xFFFF);
    case 5: return ~0ull - (x & 0xFFFF);
    case 6: return 1ull << (x & 63);
    case 7: return MB->io_buf + x % MB->io_buf_size;
    case 8: return (1ull << 63) + (x & 0xFFFF);
    case 9: return ram > spare ? spare + ((x % (ram - spare)) & ~0xFFFull) : spare;
    case 10: return x & 0x1FFE00; /* sector-aligned, up to 2 MiB */
    default: return x % (2 * ram);
    }
}

/* The chaos's targets: the mailbox's arguments and free report, the block request. */
static volatile uint64_t *chaos_field(uint64_t i) {
    switch (i) {
    case 0: case 1: case 2: case 3: case 4: case 5: return &MB->arg[i];
    case 6: return &MB->free_gpa;
    case 7: return &MB->free_len;
    case 8: return &BLK->op;
    case 9: return &BLK->offset;
    case 10: return &BLK->len;
    case 11: return &BLK->buf_gpa;
    default: return &BLK->status;
    }
}

/* Whether [start, start + len) lies in RAM and meets what the chaos must not change: the
 * guest's own pages (below the I/O buffer) and the filled data. Such a request is valid, and
 * would be served: the chaos does not send it. One outside RAM or wrapping around is sent. */
static int chaos_guarded(uint64_t start, uint64_t len, uint64_t ram, uint64_t spare) {
    uint64_t end = start + len;
    if (len == 0 || end < start || end > ram) return 0;
    if (start < MB->io_buf) return 1;
    return start < spare && end > MB->app_base;
}

/* `chaos seed=N count=M`: M random steps, each writing a random value into a mailbox argument,
 * the free report or the block request, or an `out` to the block, free or model port or an
 * unknown one, or an `in`. Results: outs sent, outs held back (see chaos_guarded), ins. */
static void op_chaos(uint64_t seed, uint64_t count) {
    uint64_t s = seed_state(seed, 0xC4A05), ram = MB->app_base + MB->app_size;
    uint64_t spare = MB->app_base + ((filled + 4095) & ~4095ull);
    uint64_t sent = 0, held = 0, ins = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t what = next_random(&s) % 8;
        if (what < 4) {
            uint64_t field = next_random(&s) % 13;
            uint64_t value = chaos_value(&s, ram, spare);
            if (field == 8 && (value & 1)) value = next_random(&s) % 5; /* a real op, often */
            *chaos_field(field) = value;
            continue;
        }
        if (what == 7) {
            ins++;
            (void)in((uint16_t)(next_random(&s) & 0x7FFF)); /* see the ports below */
            continue;
        }
        uint64_t port;
        switch (next_random(&s) % 7) {
        case 0: case 1: port = PORT_BLK; break;
        case 2: case 3: port = PORT_FREE; break;
        case 4: port = PORT_MODEL; break;
        /* Below 0x8000: on the nested KVM this project runs on, an `out` to some ports just
         * above (0x8000-0x8002, 0x8005, 0x800d) makes the outer hypervisor shut the vCPU down
         * before the VMM sees the exit: out of the VMM's hands. */
        default: port = next_random(&s) & 0x7FFF; break;
        }
        if (port == PORT_DONE) continue; /* that one ends the command */
        if ((port == PORT_BLK && BLK->op == BLK_READ &&
             chaos_guarded(BLK->buf_gpa, BLK->len, ram, spare)) ||
            (port == PORT_FREE && chaos_guarded(MB->free_gpa, MB->free_len, ram, spare))) {
            held++;
            continue;
        }
        sent++;
        out((uint16_t)port);
    }
    MB->result[0] = sent;
    MB->result[1] = held;
    MB->result[3] = ins;
}

__attribute__((noreturn, section(".text.start"))) void _start(void) {
    for (;;) {
        out(PORT_DONE);
        uint64_t op = MB->op, st = ST_OK;
        MB->result[0] = MB->result[1] = MB->result[3] = 0;
        switch (op) {
        case OP_FILL:
            st = op_fill(MB->arg[0], MB->arg[1], MB->arg[2], MB->arg[5]);
            break;
        case OP_DIGEST: {
            /* The application data: the first arg[0] bytes; an arena: what was filled. */
            uint64_t base, size, *done;
            if (target(MB->arg[5], &base, &size, &done)) { st = ST_ARENA; break; }
            uint64_t bytes = MB->arg[5] ? *done : MB->arg[0];
            if (bytes > size) { st = ST_TOO_LARGE; break; }
            MB->result[0] = digest((const uint64_t *)base, bytes);
            MB->result[1] = bytes;
            break;
        }
        case OP_ARENA:
            st = op_arena(MB->arg[0], MB->arg[1], MB->arg[2], MB->arg[3]);
            break;
        case OP_TOUCH: {
            uint64_t sum = 0;
            st = op_touch(MB->arg[0], MB->arg[5], &sum);
            MB->result[0] = sum;
            break;
        }
        case OP_REWRITE: {
            uint64_t pages = 0;
            st = op_rewrite(MB->arg[0], MB->arg[1], &pages);
            MB->result[0] = pages;
            break;
        }
        case OP_RELEASE: {
            /* The application data, then the arenas freed since the last release. */
            uint64_t released = 0;
            MB->free_gpa = MB->app_base;
            MB->free_len = (filled + 4095) & ~4095ull;
            for (int i = -1; i < UNREPORTED_MAX && !st; i++) {
                if (i >= 0) {
                    MB->free_gpa = unreported[i].base;
                    MB->free_len = unreported[i].len;
                }
                MB->free_status = 0;
                if (MB->free_len) out(PORT_FREE);
                if (MB->free_status) { st = ST_RELEASE; break; }
                released += MB->free_len;
                if (i < 0) filled = 0;
                else unreported[i].len = 0;
            }
            MB->result[0] = released;
            break;
        }
        case OP_POKE: {
            /* `poke GPA VALUE [out=PORT]`: one word written, then one `out` (0: none).
             * Results: the block request's status, the free report's, the model's error
             * flag. */
            uint64_t gpa = MB->arg[0], value = MB->arg[1], port = MB->arg[2];
            *(volatile uint64_t *)gpa = value;
            /* A 32-bit `out` of the poked page's number: what the arena port reads (the
             * others take no value); a byte `out` where four bytes would run past the I/O
             * space (this host's hypervisor faults such an `outl`). */
            if (port > 0xfffc) out((uint16_t)port);
            else if (port) outl((uint16_t)port, (uint32_t)(gpa >> 12));
            MB->result[0] = BLK->status;
            MB->result[1] = MB->free_status;
            MB->result[3] = MB->arg[2];
            break;
        }
        case OP_CHAOS:
            op_chaos(MB->arg[0], MB->arg[1]);
            break;
        case OP_DOWNLOAD:
        case OP_READ: {
            uint64_t got = 0, chunks = 0, err = 0;
            st = op_download(op == OP_READ ? NET_READ : NET_GET, MB->arg[0], &got, &chunks, &err);
            MB->result[0] = st ? 0 : digest((const uint64_t *)MB->app_base, got);
            MB->result[1] = got;
            MB->result[3] = err;
            MB->result[4] = chunks;
            break;
        }
        case OP_TASK: {
            uint64_t d = 0;
            st = op_task(&d);
            MB->result[0] = d;
            MB->result[1] = filled;
            break;
        }
        case OP_MODEL:
        case OP_MODEL_STREAM: {
            /* The VMM answers in io_buf: arg[1] bytes, arg[2] nonzero on an error. While the
             * guest waits it may keep a timer of arg[3] ms: before each `out` it hands its idle
             * state over on the arena channel (kind 4: its next timer fires in that many ns,
             * or none is pending), as a Linux guest's idle handoff does (arg[5] in ms if the
             * host refused it, 0 for none), and the VMM comes
             * back early with arg[4] set when the timer falls due; the guest does the timer's
             * work (a heartbeat over its own memory and the first word of its data) and waits
             * on for the same answer. OP_MODEL_STREAM takes the answer in batches as it
             * streams in: the VMM comes back with arg[4] = 2 and the answer so far in io_buf
             * (arg[1] bytes in all); the guest reads the new bytes (an agent reading tokens as
             * they come) and waits for the next batch, until it comes back with arg[4] = 0
             * and the whole answer. Results: digest, bytes, beats, batches. */
            uint64_t period = MB->arg[3], beats = 0, batches = 0, seen = 0;
            MB->arg[1] = 0;
            MB->arg[2] = 0;
            for (;;) {
                MB->arg[4] = 0;
                AR->kind = AR_IDLE;
                AR->id = period * 1000000;
                AR->intent = period ? 1 : 0;
                AR->count = 0;
                /* Refused (a host without the channel, or past its rate): arg[5] says it. */
                MB->arg[5] = arena_send() ? period : 0;
                out(PORT_MODEL);
                if (MB->arg[4] == 2 && op == OP_MODEL_STREAM) {
                    uint64_t upto = MB->arg[1] < MB->io_buf_size ? MB->arg[1] : MB->io_buf_size;
                    batches++;
                    for (; seen < upto; seen++)
                        heartbeat += ((volatile const uint8_t *)MB->io_buf)[seen];
                    continue;
                }
                if (MB->arg[4] != 1) break;
                beats++;
                heartbeat += beats + (filled ? *(volatile const uint64_t *)MB->app_base : 0);
            }
            MB->result[3] = beats;
            MB->result[4] = batches;
            if (MB->arg[2]) { st = ST_MODEL; break; }
            MB->result[0] = digest((const uint64_t *)MB->io_buf, MB->arg[1]);
            MB->result[1] = MB->arg[1];
            break;
        }
        default:
            st = ST_BAD_OP;
        }
        MB->result[2] = filled;
        MB->status = st;
    }
}
