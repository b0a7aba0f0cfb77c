//! The guest's downloads with a real vCPU and a real HTTP origin on loopback: a `download`
//! arrives byte for byte in the guest's memory, across offloads while the origin pauses;
//! an origin the VM does not allow is refused; an origin that stalls, lies about the length
//! or fails ends the command with an error, and the VM goes on.

// Test code: a failed setup step should stop the test on the spot.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use uffd_pager::pager::RamKind;
use vmm::gateway::Batching;
use vmm::net::{Allow, NetOptions};
use vmm::script;
use vmm::vm::{Vm, VmError, VmOptions};
use vmm::wait::WaitPolicy;

fn skip() -> bool {
    testkit::skip_unless(&["/dev/kvm", "/dev/userfaultfd"])
}

/// The body of `/data/N…`: N bytes of a pattern.
fn body(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 4093) as u8).collect()
}

/// An HTTP/1.1 origin on a thread. Paths:
/// - `/data/N/P/GAP`: N bytes in P parts, GAP ms apart (content-length announced);
/// - `/chunked/N`: N bytes, chunked, no length announced;
/// - `/stall/N`: announces N bytes, sends half, then nothing (the connection stays open);
/// - `/short/N`: announces N bytes, sends half and closes;
/// - `/trickle`: announces a megabyte and sends a byte every 200 ms;
/// - `/missing`: 404.
fn origin() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let path = testkit::http::read_head(&stream);
                let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
                let number = |i: usize| parts.get(i).and_then(|p| p.parse::<usize>().ok());
                let head = |len: usize| {
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n")
                };
                match parts[0] {
                    "data" => {
                        let (len, pieces, gap) =
                            (number(1).unwrap(), number(2).unwrap(), number(3).unwrap());
                        let data = body(len);
                        let _ = stream.write_all(head(len).as_bytes());
                        for (k, piece) in data.chunks(len.div_ceil(pieces)).enumerate() {
                            if k > 0 {
                                std::thread::sleep(Duration::from_millis(gap as u64));
                            }
                            let _ = stream.write_all(piece);
                        }
                    }
                    "chunked" => {
                        let data = body(number(1).unwrap());
                        let _ = stream.write_all(
                            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
                        );
                        for piece in data.chunks(100_000) {
                            let _ = write!(stream, "{:x}\r\n", piece.len());
                            let _ = stream.write_all(piece);
                            let _ = stream.write_all(b"\r\n");
                        }
                        let _ = stream.write_all(b"0\r\n\r\n");
                    }
                    "trickle" => {
                        let _ = stream.write_all(head(1 << 20).as_bytes());
                        for _ in 0..100 {
                            std::thread::sleep(Duration::from_millis(200));
                            if stream.write_all(b"x").is_err() {
                                break;
                            }
                        }
                    }
                    "stall" | "short" => {
                        let len = number(1).unwrap();
                        let _ = stream.write_all(head(len).as_bytes());
                        let _ = stream.write_all(&body(len)[..len / 2]);
                        if parts[0] == "stall" {
                            std::thread::sleep(Duration::from_secs(30));
                        }
                    }
                    _ => {
                        let _ = stream.write_all(
                            b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\nconnection: close\r\n\r\nno such x",
                        );
                    }
                }
            });
        }
    });
    format!("http://{address}")
}

fn start(dir: &Path, memory: u64, allow: &[&str], wait: Option<WaitPolicy>) -> Vm {
    Vm::start(VmOptions {
        io_threads: 1,
        net: NetOptions {
            allow: Allow::parse(allow).unwrap(),
            chunking: Batching {
                bytes: 1 << 20,
                wait: Duration::from_millis(50),
                buffer: 4 << 20,
            },
            stall: Duration::from_millis(700),
            timeout: Duration::from_millis(2500),
        },
        wait,
        ..VmOptions::new(memory, RamKind::Anon, dir.join("disk"), dir.join("ram"))
    })
    .unwrap()
}

fn failure(result: Result<Vec<vmm::machine::CommandOutput>, VmError>) -> String {
    basics::error_chain(&result.expect_err("the command fails"))
}

#[test]
fn download_arrives_byte_exact_in_the_guests_memory_in_chunks() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let url = origin();
    let mut vm = start(dir.path(), 64 << 20, &[&url], None);
    let len = (3 << 20) + 12345;
    let expected = vmm::guest::digest_hex(&body(len));
    let script = format!(
        "fill 8MiB random seed=1; download {url}/data/{len}/4/150 bytes={len} digest={expected}; \
         digest; download {url}/chunked/700000"
    );
    let out = vm.exec(&script::parse(&script).unwrap()).unwrap();
    assert_eq!(out[1].download_bytes, Some(len as u64));
    assert_eq!(out[1].digest.as_deref(), Some(expected.as_str()));
    // Four parts 150 ms apart, a chunk at 1 MiB or after 50 ms: several chunks.
    assert!(out[1].chunks.unwrap() >= 3, "{:?}", out[1]);
    // The download replaced the data, as `fill` would.
    assert_eq!(out[1].app_bytes, len as u64);
    assert_eq!(out[2].digest.as_deref(), Some(expected.as_str()));
    // No length announced: read to the end.
    assert_eq!(out[3].download_bytes, Some(700_000));
    assert_eq!(
        out[3].digest.as_deref(),
        Some(vmm::guest::digest_hex(&body(700_000)).as_str())
    );
    // Expectations the bytes do not meet fail the command.
    let wrong = format!("download {url}/data/4096/1/0 bytes=4097");
    let why = failure(vm.exec(&script::parse(&wrong).unwrap()));
    assert!(why.contains("got 4096 bytes, expected 4097"), "{why}");
}

#[test]
fn download_across_three_offloads_is_byte_exact_and_keeps_the_rest_of_ram() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let url = origin();
    let policy = WaitPolicy {
        offload_cooldown: Duration::ZERO,
        break_even: 0.0,
        ..WaitPolicy::default()
    };
    let mut vm = start(dir.path(), 64 << 20, &[&url], Some(policy));
    // Four parts, 600 ms apart: the VM waits three times with nothing to do.
    let len = 2 << 20;
    let out = vm
        .exec(&script::parse(&format!("download {url}/data/{len}/4/600; digest")).unwrap())
        .unwrap();
    let expected = vmm::guest::digest_hex(&body(len));
    assert_eq!(out[0].digest.as_deref(), Some(expected.as_str()));
    assert_eq!(out[1].digest.as_deref(), Some(expected.as_str()));
    let stats = vm.stats();
    let wait = stats.wait.unwrap();
    assert!(wait.offloads >= 3, "{wait:?}");
    assert!(wait.resumes >= 3, "{wait:?}");
    assert_eq!(wait.failed_offloads + wait.failed_loads, 0, "{wait:?}");
    // Each chunk was handed over within the bound once deliverable.
    assert!(wait.batches >= 3, "{wait:?}");
    assert_eq!(wait.batches_late, 0, "{wait:?}");
    // All of it in the download's counters, none in the model's.
    let sources = stats.sources.unwrap();
    let (download, model) = (sources.download, sources.model);
    assert_eq!(download.offloads, wait.offloads, "{sources:?}");
    assert_eq!(download.batches, wait.batches, "{sources:?}");
    assert_eq!(download.batch_delay_us, wait.batch_delay_us, "{sources:?}");
    assert_eq!(download.batches_late, 0, "{sources:?}");
    assert_eq!(
        (model.waits, model.offloads, model.batches),
        (0, 0, 0),
        "{sources:?}"
    );
}

#[test]
fn download_refused_origins_and_failing_origins_end_the_command_and_the_vm_goes_on() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (url, other) = (origin(), origin());
    let mut vm = start(dir.path(), 16 << 20, &[&url], None);
    let fails = |vm: &mut Vm, command: String| failure(vm.exec(&script::parse(&command).unwrap()));
    // Another port on the same host is another origin.
    let why = fails(&mut vm, format!("download {other}/data/10/1/0"));
    assert!(
        why.contains("not an allowed origin") && why.contains("errno 13"),
        "{why}"
    );
    // An origin that stops sending: given up after the stall time (700 ms here).
    let started = std::time::Instant::now();
    let why = fails(&mut vm, format!("download {url}/stall/200000"));
    assert!(
        why.contains("nothing from the origin") && why.contains("errno 110"),
        "{why}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // One that sends a byte now and then: no stall, but over in the download's time limit.
    let started = std::time::Instant::now();
    let why = fails(&mut vm, format!("download {url}/trickle"));
    assert!(
        why.contains("not done within") && why.contains("errno 110"),
        "{why}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    // One that announces more than it sends.
    let why = fails(&mut vm, format!("download {url}/short/200000"));
    assert!(why.contains("errno 5"), "{why}");
    // An error status.
    let why = fails(&mut vm, format!("download {url}/missing"));
    assert!(why.contains("404"), "{why}");
    // More than the guest's memory holds: refused as soon as the length is announced.
    let why = fails(&mut vm, format!("download {url}/data/{}/1/0", 32 << 20));
    assert!(why.contains("errno 27"), "{why}");
    // The VM goes on.
    let out = vm
        .exec(
            &script::parse(&format!(
                "fill 4MiB random seed=5; digest; download {url}/data/5000/2/10"
            ))
            .unwrap(),
        )
        .unwrap();
    assert_eq!(
        out[2].digest.as_deref(),
        Some(vmm::guest::digest_hex(&body(5000)).as_str())
    );
    // A VM without --vm-net-allow has no network.
    let dir = tempfile::tempdir().unwrap();
    let mut bare = start(dir.path(), 16 << 20, &[], None);
    let why = fails(&mut bare, format!("download {url}/data/10/1/0"));
    assert!(why.contains("has no network"), "{why}");
}
