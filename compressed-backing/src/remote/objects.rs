//! Single objects beside a store under the same prefix (a snapshot's manifest and disk, a
//! lease): read bounded, downloaded to a private file, put from bytes or a file.

use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::{run, Remote, RemoteError};
use crate::file;
use crate::store::StoreError;

/// Parts of a multipart put from a file.
const PART_BYTES: u64 = 8 << 20;
/// The first bytes of an object sealed whole.
const SEALED_OBJECT_MAGIC: &[u8; 8] = b"PVSEALO1";
/// The largest file sealed whole (it is sealed in memory).
const SEALED_OBJECT_LIMIT: u64 = 1 << 30;

/// How a put treats an object already there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutIf {
    /// Replace it.
    Any,
    /// Only create: an object there is [`RemoteError::Exists`].
    Absent,
    /// Only replace this version of it: another is [`RemoteError::Exists`].
    Version(object_store::UpdateVersion),
}

impl Remote {
    /// The object `name` under the prefix, whole, if it exists and is at most `limit` bytes
    /// (a larger one is an error, read no further than the limit).
    pub fn get_bounded(&self, name: &str, limit: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        Ok(self.get_versioned(name, limit)?.map(|(bytes, _)| bytes))
    }

    /// [`get_bounded`](Self::get_bounded) with the version read, for a put that replaces
    /// exactly that version ([`PutIf::Version`]).
    pub fn get_versioned(
        &self,
        name: &str,
        limit: u64,
    ) -> Result<Option<(Vec<u8>, object_store::UpdateVersion)>, RemoteError> {
        let client = self.client.clone();
        let key = self.key(name);
        let url = self.url.clone();
        let name_owned = name.to_owned();
        let on_error = self.request_error("get", name);
        let got = run(async move {
            let result = match client.get(&key).await {
                Ok(result) => result,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(e),
            };
            if result.meta.size > limit {
                return Ok(Some(Err(result.meta.size)));
            }
            let version = object_store::UpdateVersion {
                e_tag: result.meta.e_tag.clone(),
                version: result.meta.version.clone(),
            };
            let mut bytes = Vec::new();
            let mut stream = result.into_stream();
            while let Some(piece) = stream.next().await {
                bytes.extend_from_slice(&piece?);
                if bytes.len() as u64 > limit {
                    return Ok(Some(Err(bytes.len() as u64)));
                }
            }
            Ok(Some(Ok((bytes, version))))
        })
        .map_err(on_error)?;
        match got {
            None => Ok(None),
            Some(Ok(found)) => Ok(Some(found)),
            Some(Err(size)) => Err(RemoteError::TooLarge {
                url: url.clone(),
                name: name_owned,
                size,
                limit,
            }),
        }
    }

    /// Downloads the object `name` into `path`, a new file (0600, never through a link).
    /// Returns its size; `None` if there is no such object.
    ///
    /// With a key, the object must be sealed ([`put_file`](Self::put_file) sealed it): it is
    /// opened, and `path` holds the plain bytes.
    ///
    /// At most `limit` plain bytes are accepted (the size a manifest promises, say): a larger
    /// object is an error once that much was read.
    pub fn download(
        &self,
        name: &str,
        path: &Path,
        limit: u64,
    ) -> Result<Option<u64>, RemoteError> {
        let stored_limit = if self.options.key.is_some() {
            limit.saturating_add((SEALED_OBJECT_MAGIC.len() + 28) as u64)
        } else {
            limit
        };
        let got = self.download_as_stored(name, path, stored_limit)?;
        if got.is_none() || self.options.key.is_none() {
            return Ok(got);
        }
        let opened = (|| {
            let stored = file::read_bounded(path, stored_limit)
                .map_err(|e| RemoteError::Store(StoreError::File(e)))?;
            let plain = self.open_object(name, stored)?;
            let _ = fs::remove_file(path);
            let mut out = file::create_private(path).map_err(StoreError::File)?;
            out.write_all(&plain)
                .map_err(StoreError::io("write", path))?;
            out.sync_all().map_err(StoreError::io("sync", path))?;
            Ok(plain.len() as u64)
        })();
        if opened.is_err() {
            let _ = fs::remove_file(path);
        }
        opened.map(Some)
    }

    fn download_as_stored(
        &self,
        name: &str,
        path: &Path,
        limit: u64,
    ) -> Result<Option<u64>, RemoteError> {
        let url = self.url.clone();
        let name_owned = name.to_owned();
        let client = self.client.clone();
        let key = self.key(name);
        let on_error = self.request_error("get", name);
        let target = path.to_path_buf();
        let result = run(async move {
            let result = match client.get(&key).await {
                Ok(result) => result,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(Err(e)),
            };
            let mut out = file::create_private(&target)
                .map_err(|e| Ok(RemoteError::Store(StoreError::File(e))))?;
            let mut stream = result.into_stream();
            let mut written = 0u64;
            while let Some(piece) = stream.next().await {
                let piece = piece.map_err(Err)?;
                if written + piece.len() as u64 > limit {
                    return Err(Ok(RemoteError::TooLarge {
                        url,
                        name: name_owned,
                        size: written + piece.len() as u64,
                        limit,
                    }));
                }
                out.write_all(&piece)
                    .map_err(|e| Ok(StoreError::io("write", &target)(e).into()))?;
                written += piece.len() as u64;
            }
            out.sync_all()
                .map_err(|e| Ok(StoreError::io("sync", &target)(e).into()))?;
            Ok(Some(written))
        });
        match result {
            Ok(size) => Ok(size),
            Err(Ok(e)) => {
                let _ = fs::remove_file(path);
                Err(e)
            }
            Err(Err(e)) => {
                let _ = fs::remove_file(path);
                Err(on_error(e))
            }
        }
    }

    /// `plain` as the object `name` is stored: sealed whole with the key, if there is one.
    pub fn seal_object(&self, name: &str, plain: &[u8]) -> Vec<u8> {
        match &self.options.key {
            Some(key) => {
                let mut sealed = SEALED_OBJECT_MAGIC.to_vec();
                key.seal(
                    &crate::seal::object_aad(&self.url.to_string(), name),
                    plain,
                    &mut sealed,
                );
                sealed
            }
            None => plain.to_vec(),
        }
    }

    /// The plain bytes of the object `name` as read (`stored`): opened with the key, if there
    /// is one; a sealed object without a key, or a plain one with a key, is refused.
    pub fn open_object(&self, name: &str, mut stored: Vec<u8>) -> Result<Vec<u8>, RemoteError> {
        let sealed = stored.starts_with(SEALED_OBJECT_MAGIC);
        let Some(key) = self.key_for(sealed)? else {
            return Ok(stored);
        };
        let len = key
            .open(
                &crate::seal::object_aad(&self.url.to_string(), name),
                &mut stored[SEALED_OBJECT_MAGIC.len()..],
            )
            .map_err(|_| RemoteError::ObjectUnsealed {
                url: self.url.clone(),
                name: name.to_owned(),
            })?;
        stored.drain(..SEALED_OBJECT_MAGIC.len());
        stored.truncate(len);
        Ok(stored)
    }

    /// The keys of every object under this prefix, path segment by segment (`PREFIX/…`,
    /// not `PREFIX-other/…`); of the whole bucket for a store at its top.
    pub(crate) fn list_objects(&self) -> Result<Vec<ObjectPath>, RemoteError> {
        let client = self.client.clone();
        let prefix =
            (!self.url.prefix.is_empty()).then(|| ObjectPath::from(self.url.prefix.as_str()));
        let on_error = self.request_error("list", "");
        run(async move {
            client
                .list(prefix.as_ref())
                .map_ok(|meta| meta.location)
                .try_collect()
                .await
        })
        .map_err(on_error)
    }

    /// The name below this prefix of the object `key`, if it is under it.
    pub(crate) fn name_of<'a>(&self, key: &'a str) -> Option<&'a str> {
        if self.url.prefix.is_empty() {
            Some(key)
        } else {
            key.strip_prefix(self.url.prefix.as_str())?
                .strip_prefix('/')
        }
    }

    /// Deletes the objects `keys` (as [`list_objects`](Self::list_objects) gives them); one
    /// gone already counts as deleted. Returns how many.
    pub(crate) fn delete_objects(&self, keys: Vec<ObjectPath>) -> Result<usize, RemoteError> {
        let mut deleted = 0;
        for key in keys {
            let name = self
                .name_of(key.as_ref())
                .unwrap_or(key.as_ref())
                .to_owned();
            let on_error = self.request_error("delete", &name);
            let client = self.client.clone();
            match run(async move { client.delete(&key).await }) {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
                Err(e) => return Err(on_error(e)),
            }
        }
        Ok(deleted)
    }

    /// Deletes every object under this prefix (the whole of an upload that lost its race,
    /// say); returns how many. A store at the top of a bucket (no prefix) is refused. Best
    /// effort for the caller: an object another writer adds meanwhile may stay.
    pub fn delete_all(&self) -> Result<usize, RemoteError> {
        if self.url.prefix.is_empty() {
            return Err(RemoteError::WholeBucket {
                url: self.url.clone(),
            });
        }
        self.delete_objects(self.list_objects()?)
    }

    /// Puts `bytes` as the object `name`.
    pub fn put_bytes(&self, name: &str, bytes: Vec<u8>, put_if: PutIf) -> Result<(), RemoteError> {
        let client = self.client.clone();
        let key = self.key(name);
        let mode = match put_if {
            PutIf::Any => PutMode::Overwrite,
            PutIf::Absent => PutMode::Create,
            PutIf::Version(version) => PutMode::Update(version),
        };
        let put = run(async move {
            client
                .put_opts(
                    &key,
                    PutPayload::from(bytes),
                    PutOptions {
                        mode,
                        ..PutOptions::default()
                    },
                )
                .await
        });
        self.put_result(name, put.map(|_| ()))
    }

    /// Puts the first `len` bytes of the file at `path` as the object `name`: one request
    /// up to 16 MiB, parts of 8 MiB above (at most one part in memory).
    ///
    /// With a key, the file (at most 1 GiB) is sealed whole, its name bound in.
    pub fn put_file(&self, name: &str, path: &Path, len: u64) -> Result<(), RemoteError> {
        if self.options.key.is_some() {
            if len > SEALED_OBJECT_LIMIT {
                return Err(RemoteError::TooLarge {
                    url: self.url.clone(),
                    name: name.to_owned(),
                    size: len,
                    limit: SEALED_OBJECT_LIMIT,
                });
            }
            let f = file::open_read(path).map_err(StoreError::File)?;
            let mut plain = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
            f.read_exact_at(&mut plain, 0)
                .map_err(StoreError::io("read", path))?;
            return self.put_bytes(name, self.seal_object(name, &plain), PutIf::Absent);
        }
        let remote = self.clone();
        let name_owned = name.to_owned();
        let path = path.to_path_buf();
        run(async move { put_file(&remote, &name_owned, &path, len, &|_| {}).await })
    }

    pub(super) fn put_result(
        &self,
        name: &str,
        put: Result<(), object_store::Error>,
    ) -> Result<(), RemoteError> {
        match put {
            Ok(()) => Ok(()),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Err(RemoteError::Exists {
                url: self.url.clone(),
                name: name.to_owned(),
            }),
            Err(e) => Err(self.request_error("put", name)(e)),
        }
    }
}

/// Puts the first `len` bytes of `path` as object `name`, created only if absent (a chunk's
/// name is never reused); `progress` gets the bytes as they go.
pub(super) async fn put_file(
    remote: &Remote,
    name: &str,
    path: &Path,
    len: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(), RemoteError> {
    let key = remote.key(name);
    let file = file::open_read(path).map_err(StoreError::File)?;
    let read = |offset: u64, n: u64| -> Result<Vec<u8>, RemoteError> {
        let mut buf = vec![0u8; usize::try_from(n).unwrap_or(usize::MAX)];
        file.read_exact_at(&mut buf, offset)
            .map_err(StoreError::io("read", path))?;
        Ok(buf)
    };
    if len <= 2 * PART_BYTES {
        let bytes = read(0, len)?;
        let put = remote
            .client
            .put_opts(
                &key,
                PutPayload::from(bytes),
                PutOptions {
                    mode: PutMode::Create,
                    ..PutOptions::default()
                },
            )
            .await;
        remote.put_result(name, put.map(|_| ()))?;
        progress(len);
        return Ok(());
    }
    let mut upload = remote
        .client
        .put_multipart(&key)
        .await
        .map_err(remote.request_error("start a multipart upload of", name))?;
    let mut offset = 0;
    while offset < len {
        let n = PART_BYTES.min(len - offset);
        let part = match read(offset, n) {
            Ok(part) => part,
            Err(e) => {
                let _ = upload.abort().await;
                return Err(e);
            }
        };
        if let Err(e) = upload.put_part(PutPayload::from(part)).await {
            let _ = upload.abort().await;
            return Err(remote.request_error("put a part of", name)(e));
        }
        offset += n;
        progress(n);
    }
    upload
        .complete()
        .await
        .map_err(remote.request_error("complete the upload of", name))?;
    Ok(())
}
