//! What a sandbox is made from (`image.uri`, or `snapshotId`): the plain workload guest
//! (`pvisor:workload`), or a snapshot made with `pvisor snapshot --out DIR` (or uploaded to an
//! object store with `pvisor snapshot --out s3://…`) and served under a name (`--template
//! NAME=DIR|s3://BUCKET/PREFIX`), restored into each sandbox's own RAM: its pager brings the
//! snapshot's pages in as the guest touches them, the governor takes them back like any
//! other, and what one sandbox writes no other sees.

use std::path::{Path, PathBuf};

use compressed_backing::remote::{RemoteOptions, StoreLocation};

use crate::model::WORKLOAD_TEMPLATE;

/// Where a template's snapshot is.
#[derive(Debug, Clone)]
pub enum SnapshotAt {
    /// A directory (not a link to one).
    Dir(PathBuf),
    /// A prefix of an object store, with its manifest as the daemon read it (the VMs need not
    /// fetch it again).
    Remote(Box<vmm::vm::RemoteSnapshot>),
}

/// One template.
#[derive(Debug, Clone)]
pub struct Template {
    /// Its name, as clients give it.
    pub name: String,
    /// The snapshot its sandboxes are restored from (`None`: the workload guest, started
    /// afresh).
    pub snapshot: Option<SnapshotAt>,
    /// Bytes of guest RAM of its sandboxes (a snapshot's own).
    pub memory: u64,
}

/// The templates a daemon serves.
#[derive(Debug, Clone)]
pub struct Templates {
    list: Vec<Template>,
}

/// Longest template name.
const MAX_NAME: usize = 64;

/// `--template NAME=DIR|s3://BUCKET/PREFIX`: a name and where its snapshot is.
pub fn parse_template(text: &str) -> Result<(String, StoreLocation), String> {
    let (name, at) = text.split_once('=').ok_or_else(|| {
        format!(
            "`{text}`: expected NAME=DIR or NAME=s3://BUCKET/PREFIX (a snapshot made with \
             `pvisor snapshot --out`)"
        )
    })?;
    check_name(name)?;
    if at.is_empty() {
        return Err(format!("`{text}`: no snapshot location after `=`"));
    }
    let at = StoreLocation::parse(at).map_err(|e| format!("`{text}`: {e}"))?;
    Ok((name.to_owned(), at))
}

/// A name clients can send back as it is: letters, digits and `._:/-`, at most 64, not the
/// workload guest's.
fn check_name(name: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._:/-".contains(c);
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(allowed) {
        return Err(format!(
            "template name `{name}`: 1 to {MAX_NAME} letters, digits or `._:/-`"
        ));
    }
    if name == WORKLOAD_TEMPLATE {
        return Err(format!(
            "template name `{name}` is the workload guest's, served always"
        ));
    }
    Ok(())
}

impl Templates {
    /// The workload guest (with `vm_memory` of RAM) and the snapshots given, each checked
    /// now: a directory (not a link to one) or a prefix of an object store (reached with
    /// `remote`) holding a snapshot `pvisor` can restore, under a name given once.
    pub fn new(
        vm_memory: u64,
        snapshots: &[(String, StoreLocation)],
        remote: &RemoteOptions,
    ) -> Result<Self, String> {
        let mut list = vec![Template {
            name: WORKLOAD_TEMPLATE.to_owned(),
            snapshot: None,
            memory: vm_memory,
        }];
        for (name, at) in snapshots {
            check_name(name)?;
            if list.iter().any(|t| &t.name == name) {
                return Err(format!("template `{name}` is given twice"));
            }
            let (snapshot, manifest) =
                reach(at, remote).map_err(|why| format!("template `{name}`: {at}: {why}"))?;
            list.push(Template {
                name: name.clone(),
                snapshot: Some(snapshot),
                memory: manifest.memory,
            });
        }
        Ok(Self { list })
    }

    /// The template called `name`.
    pub fn get(&self, name: &str) -> Option<&Template> {
        self.list.iter().find(|t| t.name == name)
    }

    /// Every name, for an error that lists them.
    pub fn names(&self) -> String {
        let names: Vec<String> = self.list.iter().map(|t| format!("`{}`", t.name)).collect();
        names.join(", ")
    }
}

/// The snapshot at `at` and its manifest, read and checked.
fn reach(
    at: &StoreLocation,
    remote: &RemoteOptions,
) -> Result<(SnapshotAt, vmm::snapshot::Manifest), String> {
    match at {
        StoreLocation::Local(dir) => {
            let dir = std::path::absolute(dir).map_err(|e| e.to_string())?;
            let manifest = snapshot_manifest(&dir)?;
            Ok((SnapshotAt::Dir(dir), manifest))
        }
        StoreLocation::Remote(url) => {
            let mut snapshot = vmm::vm::RemoteSnapshot::new(url, remote, None);
            let manifest = snapshot
                .fetch_manifest()
                .map_err(|e| basics::error_chain(&e))?;
            if manifest.leased {
                return Err(
                    "it holds a VM moved off its host (restored once, by one host), \
                            not a template"
                        .into(),
                );
            }
            Ok((SnapshotAt::Remote(Box::new(snapshot)), manifest))
        }
    }
}

/// The manifest of the snapshot in `dir`, which must be a real directory.
fn snapshot_manifest(dir: &Path) -> Result<vmm::snapshot::Manifest, String> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() {
        return Err("not a directory (a link to one is refused too)".into());
    }
    vmm::snapshot::read_manifest(dir).map_err(|e| basics::error_chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_flags_and_names_are_checked() {
        assert_eq!(
            parse_template("base=/snap").unwrap(),
            (
                "base".to_owned(),
                StoreLocation::Local(PathBuf::from("/snap"))
            )
        );
        assert!(matches!(
            parse_template("base=s3://bucket/snap").unwrap().1,
            StoreLocation::Remote(_)
        ));
        for bad in [
            "base",
            "=/snap",
            "base=",
            "base=ftp://host/snap",
            "base=s3://",
            "bad name=/snap",
            "pvisor:workload=/snap",
        ] {
            assert!(parse_template(bad).is_err(), "{bad}");
        }
        let long = format!("{}=/snap", "a".repeat(65));
        assert!(parse_template(&long).is_err());
    }

    #[test]
    fn templates_refuse_what_is_no_snapshot_or_a_link_to_one() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let remote = RemoteOptions::new();
        let local = |path: &Path| StoreLocation::Local(path.to_path_buf());
        let err = Templates::new(64 << 20, &[("e".into(), local(&empty))], &remote).unwrap_err();
        assert!(err.contains("template `e`"), "{err}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&empty, &link).unwrap();
        let err = Templates::new(64 << 20, &[("l".into(), local(&link))], &remote).unwrap_err();
        assert!(err.contains("not a directory"), "{err}");
        let templates = Templates::new(64 << 20, &[], &remote).unwrap();
        assert_eq!(templates.names(), "`pvisor:workload`");
        assert_eq!(templates.get(WORKLOAD_TEMPLATE).unwrap().memory, 64 << 20);
        assert!(templates.get("base").is_none());
    }
}
