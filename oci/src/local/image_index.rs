//! `oci index`: an image index over per-platform manifests of a layout, each with its config's platform.
use crate::local::build::{self, BuildError};
use crate::local::layout::{self, Layout, RefOrDigest};
use crate::types::spec::{self, Descriptor, Index};

/// Why an index could not be written.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
    #[error("{name} is an index, not a manifest: list the per-platform images themselves")]
    NotAManifest { name: String },
    #[error(
        "{first} and {second} are both for {platform}: an index holds one manifest per platform"
    )]
    SamePlatform {
        first: String,
        second: String,
        platform: String,
    },
}

/// Writes an index over `manifests` (ref names or digests in the layout), in their order, and
/// points `ref_name` at it. On any error the layout is left as it was.
pub fn write_index(
    layout: &Layout,
    ref_name: &str,
    manifests: &[String],
) -> Result<Descriptor, IndexError> {
    layout::validate_ref_name(ref_name)?;
    let mut entries: Vec<(String, Descriptor)> = Vec::new();
    for name in manifests {
        let mut d = layout.resolve(&RefOrDigest::parse(name)?)?;
        if spec::is_index(&d.media_type) {
            return Err(IndexError::NotAManifest { name: name.clone() });
        }
        let docs = build::read_image(layout, &d)?;
        let platform = build::config_platform(&docs.config_json);
        if let Some((first, _)) = entries
            .iter()
            .find(|(_, e)| e.platform.as_ref() == Some(&platform))
        {
            return Err(IndexError::SamePlatform {
                first: first.clone(),
                second: name.clone(),
                platform: platform.to_string(),
            });
        }
        // The index entry is the manifest's own descriptor, without the layout's ref name.
        d.annotations.remove(spec::ANNOTATION_REF_NAME);
        d.platform = Some(platform);
        entries.push((name.clone(), d));
    }
    let mut index = Index::empty();
    index.manifests = entries.into_iter().map(|(_, d)| d).collect();
    let mut rollback = layout.lock()?;
    let descriptor = build::commit_json(
        layout,
        &mut rollback,
        spec::MEDIA_TYPE_INDEX,
        &spec::to_json_bytes(&index),
    )?;
    layout.set_ref(ref_name, &descriptor)?;
    rollback.keep();
    Ok(descriptor)
}
