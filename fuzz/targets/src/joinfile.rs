//! `joinfile`: the trust a machine starts from. The first byte picks the decoder:
//!
//! - `a`: a join file, read by [`JoinFile::read`] as the agent reads it from cloud-init's folder.
//!   Ok means a well-formed token and a pinnable key; written back and read again it is the same
//!   file; its `Debug` never shows the token; `addresses` starts with `address`, each once.
//! - `b`: pinned key text (`ed25519:<base64>`): [`PinnedKey::parse`] agrees with
//!   [`pin::parse_key_text`], and a key reads back from its `Display` and from JSON.
//! - `c`: a session certificate (DER), as both TLS verifiers read it ([`pin::cert_info`]).
//! - `d`: a certificate minted for a key made from the input's first 32 bytes: [`pin::cert_info`]
//!   reads back that key and the window it was minted for.
//! - `e`: a token: [`joinfile::token_is_well_formed`] accepts exactly `fleet1_` and 43 base64url
//!   characters.
use crate::support::{fresh_dir, select, value};
use fleet_proto::joinfile::{self, JoinFile, JoinFileError};
use fleet_proto::pin::{self, PinnedKey};

pub fn joinfile(data: &[u8]) {
    let Some((which, rest)) = select(data, 5) else {
        return;
    };
    match which {
        0 => join_file(rest),
        1 => pinned_key(rest),
        2 => certificate(rest),
        3 => minted(rest),
        _ => token(rest),
    }
}

fn join_file(bytes: &[u8]) {
    let dir = fresh_dir("joinfile");
    let path = dir.join("fleet.json");
    std::fs::write(&path, bytes).expect("write the join file");
    let file = match JoinFile::read(&path) {
        Ok(file) => file,
        Err(e) => {
            let line = e.to_string();
            assert!(line.contains(&path.display().to_string()), "{line}");
            if let JoinFileError::MissingField { field, .. } = e {
                assert!(line.contains(field));
            }
            return;
        }
    };
    assert!(joinfile::token_is_well_formed(&file.token.0));
    assert_eq!(file.pin().as_bytes(), file.pinned_key().as_slice());
    // The token may also sit in another field (the file's own words); Debug must not depend on it.
    let other_token = JoinFile {
        token: joinfile::Secret(String::new()),
        ..file.clone()
    };
    assert_eq!(
        format!("{file:?}"),
        format!("{other_token:?}"),
        "Debug shows the token"
    );
    let addresses = file.addresses();
    assert_eq!(addresses[0], file.address);
    for (n, a) in addresses.iter().enumerate() {
        assert!(!addresses[..n].contains(a), "{a} twice");
    }
    // As the coordinator writes it: the same file reads back.
    let again = serde_json::to_vec(&file).expect("a join file serializes");
    std::fs::write(&path, &again).expect("write the join file again");
    let back = JoinFile::read(&path).expect("a written join file reads back");
    assert_eq!(value(&back), value(&file));
}

fn pinned_key(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let raw = pin::parse_key_text(text);
    match PinnedKey::parse(text) {
        Ok(key) => {
            assert_eq!(raw.as_deref(), Some(key.as_bytes()));
            assert_eq!(key.as_bytes().len(), 32);
            let shown = key.to_string();
            assert_eq!(shown, pin::key_text(key.as_bytes()));
            assert_eq!(PinnedKey::parse(&shown).as_ref(), Ok(&key));
            let json = serde_json::to_string(&key).expect("a key serializes");
            assert_eq!(serde_json::from_str::<PinnedKey>(&json).ok(), Some(key));
        }
        Err(why) => {
            assert!(raw.is_none());
            assert!(
                why.to_string()
                    .contains("is not ed25519:<base64 of 32 bytes>"),
                "{why}"
            );
        }
    }
}

fn certificate(der: &[u8]) {
    if let Ok(info) = pin::cert_info(der) {
        let _ = (info.key.len(), info.not_before, info.not_after);
    }
}

fn minted(bytes: &[u8]) {
    let Some(seed) = bytes.get(..32) else {
        return;
    };
    // An Ed25519 private key in PKCS#8 (RFC 8410): a fixed prefix, then the 32-byte seed.
    let mut pkcs8 = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    pkcs8.extend_from_slice(seed);
    let key = rcgen::KeyPair::try_from(pkcs8.as_slice()).expect("an Ed25519 seed is a key");
    let validity = u64::from(bytes.get(32).copied().unwrap_or(1)) * 3600 + 1;
    let cert = pin::mint_cert(&key, std::time::Duration::from_secs(validity))
        .expect("a key mints a certificate");
    let info = pin::cert_info(&cert).expect("a minted certificate reads back");
    assert_eq!(info.key, key.public_key_raw());
    let window = info.not_after - info.not_before;
    assert_eq!(window as u64, validity + pin::CLOCK_SKEW.as_secs());
}

fn token(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let well_formed = joinfile::token_is_well_formed(text);
    let expected = text.len() == joinfile::TOKEN_PREFIX.len() + 43
        && text.starts_with(joinfile::TOKEN_PREFIX)
        && text[joinfile::TOKEN_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    assert_eq!(well_formed, expected, "{text:?}");
}
