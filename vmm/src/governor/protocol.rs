//! The governor's wire protocol: one JSON object per line over a Unix stream socket, each
//! line at most [`MAX_LINE`] bytes. A VM opens with `hello` and then reports; the governor
//! answers with orders. A connection that opens with `status` gets one `status` line and is
//! closed (what `pvisor governor-status` does).

use std::io::{BufRead, ErrorKind};

use serde::{Deserialize, Serialize};

/// Longest line either side sends (a status of 256 VMs fits many times over).
pub const MAX_LINE: usize = 1 << 20;

/// What a VM (or a status client) sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ToGovernor {
    /// The first line of a VM.
    Hello {
        /// Its name (the job id).
        name: String,
        /// Its guest RAM.
        memory_bytes: u64,
        /// Guest RAM resident now.
        resident_bytes: u64,
    },
    /// Its state changed.
    State {
        /// The new state.
        state: WireState,
        /// While it waits for the model: what the wait is expected to last still.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expected_remaining_ms: Option<u64>,
    },
    /// Its periodic reading.
    Reading {
        /// Guest RAM resident.
        resident_bytes: u64,
        /// What the faults its resident limit holds would install.
        held_bytes: u64,
        /// The PSS of its guest RAM mappings, in some readings (smaps costs more to read).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        guest_pss_bytes: Option<u64>,
    },
    /// Its faults are held: it asks for its resident limit to be raised by this much.
    Request {
        /// Bytes.
        bytes: u64,
    },
    /// What came of an `offload` order.
    Offloaded {
        /// Whether the RAM went to the store.
        ok: bool,
        /// Guest RAM resident after it.
        resident_bytes: u64,
    },
    /// A status client: the answer is one `status` line.
    Status,
}

/// A VM's state on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireState {
    /// Running a command.
    Running,
    /// Waiting for the model, RAM resident (paused or about to be).
    Waiting,
    /// No command (between a replay's steps, or `idle`).
    Idle,
    /// Waiting with its RAM offloaded.
    Offloaded,
}

/// What the governor sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FromGovernor {
    /// The answer to `hello`.
    Welcome {
        /// The VM's id at the governor.
        vm: u64,
        /// The budget the governor keeps.
        budget_bytes: u64,
    },
    /// Hold faults past this many resident bytes.
    SetLimit {
        /// The limit.
        bytes: u64,
        /// Why.
        reason: String,
    },
    /// No limit any more.
    Unlimit {
        /// Why.
        reason: String,
    },
    /// Offload now if waiting (answered with `offloaded`).
    Offload {
        /// Why.
        reason: String,
    },
    /// Compress cold RAM with this cold age (a VM without cold compression ignores it).
    ColdCompress {
        /// Milliseconds.
        age_ms: u64,
        /// Why.
        reason: String,
    },
    /// The answer to `status`.
    Status(serde_json::Value),
    /// The last line before the governor closes a connection it refuses.
    Error {
        /// Why.
        message: String,
    },
}

/// Why a line could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    /// The peer closed the connection.
    #[error("the connection was closed")]
    Closed,
    /// Nothing arrived within the socket's read timeout (what was read so far is kept).
    #[error("no complete line yet")]
    Timeout,
    /// A line longer than [`MAX_LINE`].
    #[error("a line longer than {MAX_LINE} bytes")]
    TooLong,
    /// Not a message of the protocol.
    #[error("not a message: {0}")]
    Invalid(String),
    /// The socket failed.
    #[error("the socket failed")]
    Io(#[source] std::io::Error),
}

/// Reads lines of at most [`MAX_LINE`] bytes, keeping a partial line across timeouts.
#[derive(Debug, Default)]
pub struct LineReader {
    partial: Vec<u8>,
}

impl LineReader {
    /// The next message from `input` (a buffered socket with a read timeout).
    pub fn next<T: for<'de> Deserialize<'de>>(
        &mut self,
        input: &mut impl BufRead,
    ) -> Result<T, LineError> {
        loop {
            let available = match input.fill_buf() {
                Ok([]) => return Err(LineError::Closed),
                Ok(bytes) => bytes,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(LineError::Timeout)
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(LineError::Io(e)),
            };
            let (taken, complete) = match available.iter().position(|&b| b == b'\n') {
                Some(end) => (end + 1, true),
                None => (available.len(), false),
            };
            if self.partial.len() + taken > MAX_LINE + 1 {
                return Err(LineError::TooLong);
            }
            self.partial.extend_from_slice(&available[..taken]);
            input.consume(taken);
            if complete {
                let line = std::mem::take(&mut self.partial);
                return serde_json::from_slice(&line)
                    .map_err(|e| LineError::Invalid(e.to_string()));
            }
        }
    }
}

/// `message` as one line.
pub fn line(message: &impl Serialize) -> Vec<u8> {
    let mut bytes = serde_json::to_vec(message).expect("protocol messages serialize");
    bytes.push(b'\n');
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn governor_protocol_lines_round_trip_and_partial_lines_survive_timeouts() {
        let hello = ToGovernor::Hello {
            name: "vm-1".into(),
            memory_bytes: 512 << 20,
            resident_bytes: 3 << 20,
        };
        let text = String::from_utf8(line(&hello)).unwrap();
        assert_eq!(
            text,
            "{\"hello\":{\"name\":\"vm-1\",\"memory_bytes\":536870912,\"resident_bytes\":3145728}}\n"
        );
        let mut reader = LineReader::default();
        let mut input = std::io::Cursor::new(text.as_bytes().to_vec());
        assert_eq!(reader.next::<ToGovernor>(&mut input).unwrap(), hello);
        assert!(matches!(
            reader.next::<ToGovernor>(&mut input),
            Err(LineError::Closed)
        ));
        let status = String::from_utf8(line(&ToGovernor::Status)).unwrap();
        assert_eq!(status, "\"status\"\n");
        // A reading carries the guest PSS only when it has one; one without still parses.
        let reading = |pss| ToGovernor::Reading {
            resident_bytes: 1,
            held_bytes: 2,
            guest_pss_bytes: pss,
        };
        let plain = String::from_utf8(line(&reading(None))).unwrap();
        assert_eq!(
            plain,
            "{\"reading\":{\"resident_bytes\":1,\"held_bytes\":2}}\n"
        );
        for message in [reading(None), reading(Some(3))] {
            let mut input = std::io::Cursor::new(line(&message));
            assert_eq!(reader.next::<ToGovernor>(&mut input).unwrap(), message);
        }
    }

    #[test]
    fn governor_protocol_hostile_lines_are_refused() {
        let mut reader = LineReader::default();
        for bad in [
            "{\"hello\":{\"name\":\"x\"}}\n",
            "{\"request\":{\"bytes\":-1}}\n",
            "{\"request\":{\"bytes\":1,\"more\":2}}\n",
            "[]\n",
            "\n",
        ] {
            let mut input = std::io::Cursor::new(bad.as_bytes().to_vec());
            assert!(
                matches!(
                    reader.next::<ToGovernor>(&mut input),
                    Err(LineError::Invalid(_))
                ),
                "{bad}"
            );
        }
        let long = vec![b' '; MAX_LINE + 10];
        let mut input = std::io::Cursor::new(long);
        assert!(matches!(
            reader.next::<ToGovernor>(&mut input),
            Err(LineError::TooLong)
        ));
    }
}
