//! `frames`: the bytes one connection carries, read as each side reads them.
//!
//! - The coordinator's accept: the first frame, within [`MAX_UNIDENTIFIED_FRAME`], as a typed
//!   [`Opening`]: an [`Up`] (a join, hello, fetch, upload, relay, hold or copy) and the protocol
//!   versions its sender speaks.
//! - Both sessions: every later frame within [`MAX_FRAME`] as a JSON value, then as [`Up`] (the
//!   coordinator's reader) and as [`Down`] (the agent's); and the agent's typed [`Down`] reads
//!   (join, content, peer answers).
//!
//! Properties: a frame that claims more than its limit is refused as `TooLarge` having read its
//! length alone; what a read holds grows with the bytes that arrived, never with the length
//! claimed; every message decoded is written back by [`write_msg`] and read again to the same
//! value; a token or registry password never shows in `Debug`.
use crate::support::{block_on, peak_bytes, value};
use fleet_proto::protocol::{
    Command, Down, FrameError, MAX_FRAME, MAX_UNIDENTIFIED_FRAME, Opening, Up, read_msg,
    read_msg_within, write_msg,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Frames read from one input at most (an input of empty frames could hold a thousand).
const MAX_MESSAGES: usize = 256;

pub fn frames(data: &[u8]) {
    // The coordinator's first read of a connection.
    let mut rest = data;
    if let Some(opening) = read_checked::<Opening>(&mut rest, MAX_UNIDENTIFIED_FRAME) {
        round_trip(&opening);
        first_message(&opening.first);
    }
    // The session readers, both ways, from the start of the input.
    let mut rest = data;
    for _ in 0..MAX_MESSAGES {
        let Some(v) = read_checked::<serde_json::Value>(&mut rest, MAX_FRAME) else {
            break;
        };
        if let Ok(up) = serde_json::from_value::<Up>(v.clone()) {
            round_trip(&up);
            secrets_hidden_up(&up);
        }
        if let Ok(down) = serde_json::from_value::<Down>(v) {
            round_trip(&down);
            secrets_hidden_down(&down);
        }
    }
    // The agent's typed reads (join answers, content answers, a peer's answers).
    let mut rest = data;
    for _ in 0..MAX_MESSAGES {
        let Some(down) = read_checked::<Down>(&mut rest, MAX_FRAME) else {
            break;
        };
        round_trip(&down);
    }
}

/// One read of a `T` from the front of `rest`, checked against the framing's promises; `None`
/// when the connection would end here (a clean close or any error).
fn read_checked<T: DeserializeOwned>(rest: &mut &[u8], limit: usize) -> Option<T> {
    let before = *rest;
    let (read, held) = peak_bytes(|| block_on(read_msg_within::<_, T>(rest, limit)));
    // A read holds at most its first 64 KiB buffer, what arrived, and what decoding it takes
    // (a JSON value costs a few dozen bytes per byte of text at worst).
    let bound = (64 << 10) + 256 * before.len() + 4096;
    assert!(
        held <= bound,
        "a read of {} bytes held {held} bytes at once (bound {bound})",
        before.len()
    );
    let claimed = before
        .get(..4)
        .map(|len| u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize);
    match read {
        Ok(Some(msg)) => {
            let size = claimed.expect("a message had a length");
            assert!(size <= limit);
            assert_eq!(
                before.len() - rest.len(),
                4 + size,
                "a frame is its length and body"
            );
            Some(msg)
        }
        Ok(None) => {
            assert!(before.len() < 4, "a clean end only before a whole length");
            None
        }
        Err(FrameError::TooLarge { size, limit: said }) => {
            assert_eq!((Some(size), said), (claimed, limit));
            assert!(size > limit);
            assert_eq!(before.len() - rest.len(), 4, "only the length was read");
            None
        }
        Err(FrameError::Io(e)) => {
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
            let size = claimed.expect("a cut body follows a whole length");
            assert!(
                before.len() - 4 < size,
                "cut only when fewer bytes came than claimed"
            );
            None
        }
        Err(FrameError::Malformed(why)) => {
            assert!(!why.is_empty());
            None
        }
    }
}

/// What the coordinator does with a first message before anything else: reads what it names.
fn first_message(first: &Up) {
    round_trip(first);
    secrets_hidden_up(first);
    match first {
        Up::Join { token, labels, .. } => {
            // The token is checked by its shape and hash; any string may arrive.
            let _ = fleet_proto::joinfile::token_is_well_formed(&token.0);
            for (k, v) in labels {
                let _ = (k.len(), v.len());
            }
        }
        Up::Fetch { digest, .. } | Up::Copy { digest, .. } => {
            assert_eq!(
                fleet_proto::Digest::parse(&digest.to_string()).ok(),
                Some(*digest)
            );
        }
        _ => {}
    }
}

/// Writing a decoded message and reading it back gives the same message.
fn round_trip<T: Serialize + DeserializeOwned>(msg: &T) {
    let mut wire = Vec::new();
    match block_on(write_msg(&mut wire, msg)) {
        Ok(()) => {}
        // A message decoded from a frame within MAX_FRAME can grow when written again (a number
        // written in a longer form); then it is refused on the way out, never sent cut.
        Err(FrameError::TooLarge { .. }) => return,
        Err(e) => panic!("writing a decoded message failed: {e}"),
    }
    let back: T = block_on(read_msg(&mut wire.as_slice()))
        .expect("a written message reads back")
        .expect("a written message is there");
    assert_eq!(
        value(&back),
        value(msg),
        "a message reads back as it was written"
    );
}

/// `Debug` of a message never shows its join token: what Debug shows of the message with the
/// token blanked (other fields may hold the same text) is what it shows with the token in.
fn secrets_hidden_up(msg: &Up) {
    match msg {
        Up::Join {
            token,
            name,
            labels,
        } if !token.0.is_empty() => {
            let blank = Up::Join {
                token: fleet_proto::joinfile::Secret(String::new()),
                name: name.clone(),
                labels: labels.clone(),
            };
            hidden(&token.0, &format!("{msg:?}"), &format!("{blank:?}"));
        }
        Up::Relay { command, .. } => secrets_hidden_command(command),
        _ => {}
    }
}

fn secrets_hidden_down(msg: &Down) {
    if let Down::Command { command, .. } = msg {
        secrets_hidden_command(command);
    }
}

fn secrets_hidden_command(command: &Command) {
    if let Command::Start(start) = command
        && let Some(auth) = &start.registry_auth
        && !auth.password.is_empty()
    {
        let mut blank = start.clone();
        blank.registry_auth.as_mut().expect("some").password.clear();
        hidden(&auth.password, &format!("{start:?}"), &format!("{blank:?}"));
    }
}

fn hidden(secret: &str, shown: &str, shown_blank: &str) {
    if !shown_blank.contains(secret) {
        assert!(!shown.contains(secret), "Debug shows a secret: {shown}");
    }
}
