//! `oci_text`: the short texts `oci` and the fleet read from outside. The first byte picks:
//!
//! - `a`: a name, through every name parser: `oci` references (`oci:DIR:REF`, `docker://...`),
//!   ref names and digests of a layout, the fleet's image names (`HOST/REPO@sha256:HEX`), run
//!   ids, digests, platforms. Whatever parses prints back to text that parses to the same value.
//! - `b`: a `WWW-Authenticate` header. A Bearer challenge written back as a registry writes one
//!   (quoted values) parses to the same challenge.
//! - `c`: an auth file (`REGISTRY_AUTH_FILE`), a credential helper's exit status (`0` or `1`)
//!   and answer, and the host asked for, NUL-separated, through [`auth::find`] with a stand-in
//!   `docker-credential-fuzz` on PATH. A credential found is printed only by its user; an error
//!   never shows what the helper printed on stdout. `USER:PASS` (`--creds`) parses back from
//!   its parts.
//! - `d`: PEM keys: a public key reads back from its own PEM; a private key signs what its
//!   public key verifies.
//! - `e`: a certs.d folder (`ca.crt`, `client.cert`, `client.key`, NUL-separated) and a
//!   `--tls-ca` file, through [`TlsOptions::setup`]: a client identity only from a matching pair.
//! - `f`: a registry's error body, through [`oci::transfer::remote::error_detail`]: one line.
//!
//! `Link` headers are not listed: oci reads none (no paginated listing is followed).
use crate::support::{block_on, fresh_dir, one_line, sections, select};
use oci::signing::keys::{PublicKey, SigningKey};
use oci::transfer::auth::{self, Credential};
use oci::transfer::remote::challenge::{self, Challenge};
use oci::transfer::tls::TlsOptions;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

pub fn oci_text(data: &[u8]) {
    let Some((which, rest)) = select(data, 6) else {
        return;
    };
    match which {
        0 => names(rest),
        1 => www_authenticate(rest),
        2 => auth_file(rest),
        3 => pem_keys(rest),
        4 => certs_d(rest),
        _ => error_body(rest),
    }
}

fn names(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    if let Ok(r) = text.parse::<oci::transfer::reference::ImageRef>() {
        let shown = r.to_string();
        let back: oci::transfer::reference::ImageRef =
            shown.parse().expect("a reference parses back");
        assert_eq!(back, r, "{text:?} printed as {shown:?}");
        if let oci::transfer::reference::ImageRef::Registry(reg) = &r {
            let asked = reg.reference();
            assert!(
                asked == "latest"
                    || reg.tag.as_deref() == Some(&asked)
                    || asked.starts_with("sha256:")
            );
        }
    }
    match oci::RefOrDigest::parse(text) {
        Ok(oci::RefOrDigest::Name(name)) => {
            assert_eq!(name, text);
            assert!(oci::local::layout::validate_ref_name(text).is_ok());
        }
        Ok(oci::RefOrDigest::Digest(d)) => assert_eq!(d.to_string(), text),
        Err(_) => {}
    }
    if let Ok(d) = oci::Digest::parse(text) {
        assert_eq!(d.to_string(), text, "a digest has one spelling");
        assert_eq!(oci::Digest::parse(&d.hex()).ok(), None);
    }
    if let Ok(image) = fleet_proto::run::ImageRef::parse(text) {
        let shown = image.to_string();
        assert_eq!(shown, text, "an image name has one spelling");
        let json = serde_json::to_string(&image).expect("serializes");
        assert_eq!(
            serde_json::from_str::<fleet_proto::run::ImageRef>(&json).ok(),
            Some(image)
        );
    }
    if let Ok(id) = fleet_proto::RunId::parse(text) {
        assert_eq!(id.as_str(), text);
        assert!(!text.contains('/') && text != "." && text != "..");
    }
    match oci::Platform::parse(text) {
        Ok(p) => {
            let shown = p.to_string();
            assert_eq!(shown, text);
            assert_eq!(oci::Platform::parse(&shown).ok(), Some(p));
        }
        Err(e) => assert!(one_line(&e.to_string()) || text.contains(['\n', '\r'])),
    }
}

fn www_authenticate(bytes: &[u8]) {
    let Ok(header) = std::str::from_utf8(bytes) else {
        return;
    };
    let Some(parsed) = challenge::parse(header) else {
        return;
    };
    let Challenge::Bearer {
        realm,
        service,
        scope,
        error,
    } = &parsed
    else {
        return;
    };
    let fields = [
        ("realm", Some(realm)),
        ("service", service.as_ref()),
        ("scope", scope.as_ref()),
        ("error", error.as_ref()),
    ];
    // Values are quoted with no escapes, as registries write them.
    if fields
        .iter()
        .any(|(_, v)| v.is_some_and(|v| v.contains('"')))
    {
        return;
    }
    let written: Vec<String> = fields
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}=\"{v}\"")))
        .collect();
    let again = format!("Bearer {}", written.join(","));
    assert_eq!(challenge::parse(&again), Some(parsed), "{again:?}");
}

/// The auth file, the helper's folder and answer, set up once for the process: `auth::find`
/// reads the environment.
struct AuthSetup {
    file: PathBuf,
    answer: PathBuf,
    status: PathBuf,
}

fn auth_setup() -> &'static Mutex<AuthSetup> {
    static SETUP: OnceLock<Mutex<AuthSetup>> = OnceLock::new();
    SETUP.get_or_init(|| {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("fuzz-targets-auth.")
            .tempdir()
            .expect("a folder for the auth file")
            .keep();
        let bin = dir.join("bin");
        std::fs::create_dir(&bin).expect("a folder for the helper");
        let (answer, status) = (dir.join("answer"), dir.join("status"));
        let helper = bin.join("docker-credential-fuzz");
        std::fs::write(
            &helper,
            format!(
                "#!/bin/sh\n/bin/cat >/dev/null\n/bin/cat '{}'\nread s < '{}'\nexit \"$s\"\n",
                answer.display(),
                status.display()
            ),
        )
        .expect("write the helper");
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755))
            .expect("make the helper runnable");
        let file = dir.join("auth.json");
        // SAFETY: set once, before any credential lookup; nothing in these targets reads the
        // environment through libc while it is changed.
        unsafe {
            std::env::remove_var(auth::CREDS_ENV);
            std::env::set_var("REGISTRY_AUTH_FILE", &file);
            std::env::set_var("DOCKER_CONFIG", dir.join("no-docker-config"));
            std::env::set_var("PATH", &bin);
        }
        Mutex::new(AuthSetup {
            file,
            answer,
            status,
        })
    })
}

/// What an error may say of what the stand-in helper did: its stderr (always empty) or a fixed line.
const HELPER_LINES: [&str; 3] = ["", auth::HELPER_NO_JSON, auth::HELPER_NO_FIELDS];

fn auth_file(bytes: &[u8]) {
    let [config, answer, host] = sections::<3>(bytes, b"\0");
    let Ok(host) = std::str::from_utf8(host) else {
        return;
    };
    let setup = auth_setup().lock().unwrap_or_else(|p| p.into_inner());
    std::fs::write(&setup.file, config).expect("write the auth file");
    // The answer's first byte is the helper's exit status: `0` or `1`.
    let (status, answer) = match answer.split_first() {
        Some((b, rest)) => (u32::from(*b % 2), rest),
        None => (0, answer),
    };
    std::fs::write(&setup.answer, answer).expect("write the helper's answer");
    std::fs::write(&setup.status, format!("{status}\n")).expect("write the helper's status");
    match auth::find(host, None) {
        Ok(Some(c)) => {
            // Whatever came in is what goes out, in the Basic header too.
            let basic = c.basic();
            assert!(basic.starts_with("Basic "));
            assert_eq!(
                format!("{c:?}"),
                format!("Credential({}, <redacted>)", c.user)
            );
        }
        Ok(None) => {}
        Err(e) => {
            let line = e.to_string();
            assert!(one_line(&line), "an error is one line: {line:?}");
            // A helper's refusal is its own stderr (empty here) or a fixed line, never its stdout
            // (which may hold the secret); a helper other than the stand-in never ran at all.
            if let auth::AuthError::Helper { helper, msg, .. } = &e
                && helper == "fuzz"
            {
                assert!(
                    HELPER_LINES.contains(&msg.as_str()),
                    "an error shows more than the helper's stderr: {line}"
                );
            }
        }
    }
    // `--creds USER:PASS`: the user ends at the first ':'.
    if let Ok(text) = std::str::from_utf8(config)
        && let Ok(c) = Credential::parse(text, "--creds")
    {
        assert!(!c.user.is_empty() && !c.user.contains(':'));
        assert_eq!(format!("{}:{}", c.user, c.secret), text);
    }
}

fn pem_keys(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    if let Ok(key) = PublicKey::from_pem(text) {
        let pem = key.to_pem();
        let back = PublicKey::from_pem(&pem).expect("a public key reads back from its PEM");
        assert_eq!(back, key);
        assert_eq!(back.id(), key.id());
        assert!(!key.verifies(b"message", b"not a signature"));
    }
    let dir = fresh_dir("oci_text-key");
    let path = dir.join("key.pem");
    std::fs::write(&path, bytes).expect("write the key");
    match SigningKey::read(&path) {
        Ok(key) => {
            let message = bytes.get(..16).unwrap_or(bytes);
            let signature = key.sign(message);
            assert!(
                key.public().verifies(message, &signature),
                "a key's signature verifies"
            );
            let pem = key.public().to_pem();
            assert_eq!(PublicKey::from_pem(&pem).ok(), Some(key.public()));
        }
        Err(e) => {
            let line = e.to_string();
            assert!(line.contains(&path.display().to_string()), "{line}");
        }
    }
}

fn certs_d(bytes: &[u8]) {
    static ROOTS: OnceLock<()> = OnceLock::new();
    ROOTS.get_or_init(|| {
        // No system roots: reading them all for every input would be most of the work.
        let empty =
            std::env::temp_dir().join(format!("fuzz-targets-no-roots.{}", std::process::id()));
        std::fs::create_dir_all(&empty).expect("an empty root folder");
        std::fs::write(empty.join("roots.pem"), b"").expect("an empty root store");
        // SAFETY: set once, before any TLS set-up reads them.
        unsafe {
            std::env::set_var("SSL_CERT_FILE", empty.join("roots.pem"));
            std::env::set_var("SSL_CERT_DIR", &empty);
        }
    });
    let [ca, cert, key, tls_ca] = sections::<4>(bytes, b"\0");
    let dir = fresh_dir("oci_text-certs.d");
    let host = "registry.test:5000";
    let host_dir = dir.join(host);
    std::fs::create_dir_all(&host_dir).expect("a host folder");
    for (name, content) in [("ca.crt", ca), ("client.cert", cert), ("client.key", key)] {
        if !content.is_empty() {
            std::fs::write(host_dir.join(name), content).expect("write a certs.d file");
        }
    }
    let tls_ca_path = dir.join("tls-ca.pem");
    let options = TlsOptions {
        certs_dir: Some(dir.clone()),
        ca: (!tls_ca.is_empty()).then(|| {
            std::fs::write(&tls_ca_path, tls_ca).expect("write the CA file");
            tls_ca_path.clone()
        }),
        ..TlsOptions::default()
    };
    match options.setup(host) {
        Ok(setup) => {
            assert_eq!(setup.host_dir, host_dir);
            if let Some(c) = &setup.client_cert {
                assert_eq!(c, &host_dir.join("client.cert"));
                assert!(!cert.is_empty() && !key.is_empty());
            }
        }
        Err(e) => {
            let line = e.to_string();
            assert!(
                line.contains(&dir.display().to_string()) || line.contains("--tls"),
                "{line}"
            );
        }
    }
}

fn error_body(bytes: &[u8]) {
    let response = http::Response::builder()
        .status(400)
        .body(bytes.to_vec())
        .expect("a response");
    let detail = block_on(oci::transfer::remote::error_detail(
        reqwest::Response::from(response),
    ));
    assert!(
        one_line(&detail),
        "a registry's error is more than one line: {detail:?}"
    );
    assert!(detail.is_empty() || detail.starts_with(": "));
}
