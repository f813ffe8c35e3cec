//! Image pulls (the credential in that one request's header) and the marks of pulled images.
use super::{DockerRuntime, RuntimeError, describe, engine};
use bollard::query_parameters::CreateImageOptions;
use fleet_proto::RunId;
use fleet_proto::run::{ImageRef, RegistryAuth};
use futures_util::StreamExt;
use sha2::Digest as _;
use std::path::PathBuf;

impl DockerRuntime {
    /// Pulls `image`; a stalled pull is abandoned.
    pub(super) async fn pull(
        &self,
        run_id: &RunId,
        image: &ImageRef,
        auth: Option<&RegistryAuth>,
    ) -> Result<(), RuntimeError> {
        let reference = image.to_string();
        let refused = |reason: String| RuntimeError::Refused {
            run_id: run_id.clone(),
            reason,
        };
        // bollard encodes its credentials header as standard base64 while the engine decodes
        // base64url (and then silently pulls without them), so the header is ours: set on a
        // client used for this one request, gone with it.
        let docker = match auth {
            None => self.docker.clone(),
            Some(auth) => engine::speaking(
                self.docker.clone(),
                Some(("X-Registry-Auth", registry_auth_header(auth, &image.host))),
            ),
        };
        let options = CreateImageOptions {
            from_image: Some(reference.clone()),
            ..Default::default()
        };
        let mut progress = docker.create_image(Some(options), None, None);
        loop {
            match tokio::time::timeout(self.pull_stall, progress.next()).await {
                Err(_) => {
                    return Err(refused(format!(
                        "the pull of {reference} made no progress for {} s and was abandoned; check that the node reaches {}",
                        self.pull_stall.as_secs_f64(),
                        image.host
                    )));
                }
                Ok(None) => return Ok(()),
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => {
                    let hint = if auth.is_some() {
                        "check the image and the credential given with it"
                    } else {
                        "check the image, and give a credential if the registry needs one"
                    };
                    return Err(refused(format!(
                        "cannot pull {reference}: {}; {hint}",
                        describe(&e)
                    )));
                }
            }
        }
    }

    /// The file recording that this runtime pulled `image`; its time is the image's last start.
    fn image_mark(&self, image: &str) -> PathBuf {
        let name = hex::encode(sha2::Sha256::digest(image.as_bytes()));
        self.marks.join("images").join(name)
    }

    pub(super) fn mark_image_used(&self, image: &str, pulled: bool) {
        let path = self.image_mark(image);
        if pulled || path.exists() {
            // Cannot fail: the path is built as a file inside the images/ folder.
            let written = std::fs::create_dir_all(path.parent().expect("under images/"))
                .and_then(|()| std::fs::write(&path, image));
            if let Err(e) = written {
                tracing::warn!(
                    "cannot record the use of {image} in {}: {e}",
                    path.display()
                );
            }
        }
    }
}

/// `X-Registry-Auth`: the credential as JSON, in base64url (what the engine decodes).
fn registry_auth_header(auth: &RegistryAuth, host: &str) -> http::HeaderValue {
    use base64::Engine as _;
    let json = serde_json::json!({
        "username": auth.username,
        "password": auth.password,
        "serveraddress": host,
    });
    let encoded = base64::engine::general_purpose::URL_SAFE.encode(json.to_string());
    // Cannot fail: base64url is visible ASCII, always a valid header value.
    let mut value = http::HeaderValue::from_str(&encoded).expect("base64url is a header value");
    value.set_sensitive(true);
    value
}
