//! A run's start: the checks, the create (pulling a missing image), adoption, inputs, start.
use super::{
    DEFAULT_GRACE, DockerRuntime, LABEL_AGENT, LABEL_GRACE_MS, LABEL_OUTPUT_LIMIT, LABEL_RUN,
    LABEL_TIMEOUT_MS, NAME, RUN_DIR, RunSpec, RuntimeError, Started, container_name, describe,
    status_of,
};
use crate::runtime::Workload;
use bollard::models::{ContainerCreateBody, ContainerStateStatusEnum, DeviceRequest, HostConfig};
use bollard::query_parameters::{CreateContainerOptions, UploadToContainerOptions};
use fleet_proto::RunId;
use fleet_proto::run::{Gpus, ImageRef};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

/// The image and the arguments of a run, or why the engine cannot run it (a staged program, an
/// argument that is not UTF-8, a run id the run store refuses).
pub(super) fn image_and_argv(spec: &RunSpec) -> Result<(ImageRef, Vec<String>), RuntimeError> {
    let run_id = &spec.run_id;
    let unsupported = |what: String, hint| RuntimeError::Unsupported {
        run_id: run_id.clone(),
        what,
        runtime: NAME,
        hint,
    };
    let image = match &spec.workload {
        Workload::Image(image) => image.clone(),
        Workload::Program(_) => {
            return Err(unsupported(
                "a staged program".into(),
                "run programs on the process runtime",
            ));
        }
    };
    let mut argv = Vec::with_capacity(spec.argv.len());
    for (n, arg) in spec.argv.iter().enumerate() {
        let Some(text) = arg.to_str() else {
            return Err(unsupported(
                format!("argument {} (not UTF-8)", n + 1),
                "the Engine API carries arguments as text; pass UTF-8 or run it as a program",
            ));
        };
        argv.push(text.to_string());
    }
    Ok((image, argv))
}

impl DockerRuntime {
    fn create_body(
        &self,
        spec: &RunSpec,
        image: &ImageRef,
        argv: Vec<String>,
    ) -> ContainerCreateBody {
        let r = &spec.resources;
        let millis = |d: Duration| d.as_millis().to_string();
        let mut labels = HashMap::from([
            (LABEL_RUN.to_string(), spec.run_id.to_string()),
            (LABEL_AGENT.to_string(), self.agent.clone()),
            (
                LABEL_GRACE_MS.to_string(),
                millis(spec.grace.unwrap_or(DEFAULT_GRACE)),
            ),
        ]);
        if let Some(timeout) = spec.timeout {
            labels.insert(LABEL_TIMEOUT_MS.into(), millis(timeout));
        }
        if let Some(limit) = spec.output_limit {
            labels.insert(LABEL_OUTPUT_LIMIT.into(), limit.to_string());
        }
        let memory = r.memory_bytes.map(|m| m as i64);
        let gpus = match &r.gpus {
            Gpus::None => None,
            Gpus::All => Some(DeviceRequest {
                count: Some(-1),
                capabilities: Some(vec![vec!["gpu".into()]]),
                ..Default::default()
            }),
            Gpus::Ids(ids) => Some(DeviceRequest {
                device_ids: Some(ids.clone()),
                capabilities: Some(vec![vec!["gpu".into()]]),
                ..Default::default()
            }),
        };
        ContainerCreateBody {
            image: Some(image.to_string()),
            // No arguments: the image's own command.
            cmd: (!argv.is_empty()).then_some(argv),
            env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
            working_dir: Some(RUN_DIR.into()),
            labels: Some(labels),
            host_config: Some(HostConfig {
                init: Some(true),
                memory,
                // No swap beyond the limit, so the limit is what the kernel enforces.
                memory_swap: memory,
                nano_cpus: r.cpu_millis.map(|m| (m * 1_000_000) as i64),
                pids_limit: r.pids.map(|p| p as i64),
                device_requests: gpus.map(|g| vec![g]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    pub(super) async fn start_async(
        &self,
        spec: &RunSpec,
        image: &ImageRef,
        argv: Vec<String>,
    ) -> Result<Started, RuntimeError> {
        let run_id = &spec.run_id;
        let name = container_name(run_id);
        let refused = |reason: String| RuntimeError::Refused {
            run_id: run_id.clone(),
            reason,
        };
        // The create is asked first, as the `docker` CLI does: a container of this name (a
        // redelivered start) and a missing image are learned from its refusal, so the start of
        // a present image is two requests. At most one pull, and one retry after a container
        // created but never started (the agent died between the two) is removed, since its
        // inputs may be missing.
        let (mut pulled, mut retried) = (false, false);
        loop {
            let options = CreateContainerOptions {
                name: Some(name.clone()),
                ..Default::default()
            };
            let body = self.create_body(spec, image, argv.clone());
            let id = match self.docker.create_container(Some(options), body).await {
                Ok(created) => created.id,
                // The name is taken: by this run (adopted) or by another.
                Err(e) if status_of(&e) == Some(409) => {
                    if let Some(existing) = self.adopt(run_id).await? {
                        return Ok(existing);
                    }
                    if retried {
                        return Err(refused(format!(
                            "the container name {name} is taken by a container that is not this agent's run {run_id}; remove that container or use another run id"
                        )));
                    }
                    retried = true;
                    continue;
                }
                // No such image.
                Err(e) if status_of(&e) == Some(404) && !pulled => {
                    self.pull(run_id, image, spec.registry_auth.as_ref())
                        .await?;
                    pulled = true;
                    continue;
                }
                Err(e) => return Err(self.engine_error(run_id, "create the container", e)),
            };
            self.mark_image_used(&image.to_string(), pulled);
            if let Err(e) = self.launch(spec, &name).await {
                let _ = self.remove(&name).await;
                return Err(e);
            }
            // Set from now, a little after the engine's start: never early.
            if let Some(timeout) = spec.timeout {
                let grace = spec.grace.unwrap_or(DEFAULT_GRACE);
                self.timers.arm(run_id, &id, grace, timeout);
            }
            return Ok(Started::New);
        }
    }

    /// The run's container if it exists and ever started; a created, never started one is
    /// removed so the start can make it again.
    async fn adopt(&self, run_id: &RunId) -> Result<Option<Started>, RuntimeError> {
        let Some(info) = self.inspect(run_id).await? else {
            return Ok(None);
        };
        let state = info.state.as_ref().and_then(|s| s.status);
        if state == Some(ContainerStateStatusEnum::CREATED) {
            self.remove(&container_name(run_id))
                .await
                .map_err(|e| self.engine_error(run_id, "remove a half-made container", e))?;
            return Ok(None);
        }
        Ok(Some(Started::Already))
    }

    /// Copies the inputs into the run folder, then starts the container.
    async fn launch(&self, spec: &RunSpec, name: &str) -> Result<(), RuntimeError> {
        let run_id = &spec.run_id;
        if !spec.inputs.is_empty() {
            let unreadable = |e: std::io::Error| RuntimeError::Refused {
                run_id: run_id.clone(),
                reason: format!("cannot read the inputs: {e}"),
            };
            let (tar, writing) = inputs_tar(&spec.inputs).map_err(unreadable)?;
            let options = UploadToContainerOptions {
                path: "/".into(),
                ..Default::default()
            };
            let uploaded = self
                .docker
                .upload_to_container(name, Some(options), bollard::body_try_stream(tar))
                .await;
            let written = writing
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            match (uploaded, written) {
                // A closed pipe is the writer seeing the upload end; the upload says why.
                (_, Err(e)) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(unreadable(e));
                }
                (Err(e), _) => {
                    return Err(self.engine_error(run_id, "copy the inputs into /run", e));
                }
                (Ok(()), _) => {}
            }
        }
        match self.docker.start_container(name, None).await {
            Ok(()) => Ok(()),
            Err(e)
                if spec.resources.gpus != Gpus::None && describe(&e).contains("device driver") =>
            {
                Err(RuntimeError::Unsupported {
                    run_id: run_id.clone(),
                    what: format!("a GPU request (the engine says: {})", describe(&e)),
                    runtime: NAME,
                    hint: "install the NVIDIA Container Toolkit on this node, or run without GPUs",
                })
            }
            Err(e) => Err(self.engine_error(run_id, "start the container", e)),
        }
    }
}

/// The size of the chunks the inputs' tar is sent in; a few are in flight at most.
const TAR_CHUNK: usize = 64 << 10;

/// The inputs as a tar of `run/NAME` entries (unpacked at the container's root), written by a
/// blocking task into a stream of a few [`TAR_CHUNK`]s in flight, so memory stays flat
/// whatever their size. Every file is opened first: a missing one is refused before anything
/// is sent. The task's result says whether the whole tar was written.
fn inputs_tar(
    inputs: &[(String, PathBuf)],
) -> std::io::Result<(
    impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let files = inputs
        .iter()
        .map(|(name, path)| {
            let named = |e: std::io::Error| {
                std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
            };
            let file = std::fs::File::open(path).map_err(named)?;
            let size = file.metadata().map_err(named)?.len();
            Ok((name.clone(), path.clone(), file, size))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let (chunks, body) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(4);
    let failed = chunks.clone();
    let writing = tokio::task::spawn_blocking(move || {
        let written = write_inputs(files, ChunkSender(chunks));
        if let Err(e) = &written {
            // Ends the request with an error, so the engine never unpacks a cut tar.
            let _ = failed.blocking_send(Err(std::io::Error::new(e.kind(), e.to_string())));
        }
        written
    });
    let body = futures_util::stream::unfold(body, |mut body| async move {
        body.recv().await.map(|chunk| (chunk, body))
    });
    Ok((body, writing))
}

fn write_inputs(
    files: Vec<(String, PathBuf, std::fs::File, u64)>,
    sink: ChunkSender,
) -> std::io::Result<()> {
    use std::io::{Read as _, Write as _};
    let mut tar = tar::Builder::new(std::io::BufWriter::with_capacity(TAR_CHUNK, sink));
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o755);
    dir.set_size(0);
    tar.append_data(&mut dir, "run/", std::io::empty())?;
    for (name, path, file, size) in files {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o644);
        header.set_size(size);
        let mut data = file.take(size);
        tar.append_data(&mut header, format!("run/{name}"), &mut data)?;
        if data.limit() > 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} shrank while it was being sent", path.display()),
            ));
        }
    }
    tar.into_inner()?.flush()
}

/// A writer into the upload's stream of chunks; a closed stream (the upload ended) is a broken
/// pipe.
struct ChunkSender(tokio::sync::mpsc::Sender<std::io::Result<bytes::Bytes>>);

impl std::io::Write for ChunkSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(bytes::Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload ended"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
