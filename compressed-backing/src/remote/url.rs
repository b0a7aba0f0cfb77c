//! Where a store lives: a local directory or `s3://BUCKET/PREFIX`.

use std::fmt;
use std::path::PathBuf;

/// A store in an S3-compatible object store: its bucket and the key prefix its objects share
/// (no leading or trailing `/`; empty for the bucket's root).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteUrl {
    /// The bucket.
    pub bucket: String,
    /// The prefix of the store's keys, without a trailing `/`.
    pub prefix: String,
}

/// Why a store location was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{location:?} is not a store location: {reason}")]
pub struct UrlError {
    /// What was given.
    pub location: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl RemoteUrl {
    /// Parses `s3://BUCKET/PREFIX` (PREFIX optional). Bucket names follow S3's rules (3 to 63
    /// of `a-z`, `0-9`, `.`, `-`); the prefix has no empty, `.` or `..` parts and no control
    /// characters, so a key never escapes its prefix on a server that maps keys to files.
    pub fn parse(location: &str) -> Result<Self, UrlError> {
        let refuse = |reason| UrlError {
            location: location.to_owned(),
            reason,
        };
        let rest = location
            .strip_prefix("s3://")
            .ok_or_else(|| refuse("it does not start with s3://"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
            && !bucket.starts_with(['.', '-'])
            && !bucket.ends_with(['.', '-']);
        if !bucket_ok {
            return Err(refuse(
                "the bucket must be 3 to 63 characters of a-z, 0-9, '.' and '-'",
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty() {
            for part in prefix.split('/') {
                if part.is_empty() || part == "." || part == ".." {
                    return Err(refuse("the prefix has an empty, '.' or '..' part"));
                }
                if part.chars().any(char::is_control) {
                    return Err(refuse("the prefix has a control character"));
                }
            }
        }
        if prefix.len() > 512 {
            return Err(refuse("the prefix is longer than 512 bytes"));
        }
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        })
    }

    /// The key of `name` under the prefix.
    pub fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{}/{name}", self.prefix)
        }
    }
}

impl fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.prefix)
    }
}

/// A store's location as the commands take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A directory.
    Local(PathBuf),
    /// An object store.
    Remote(RemoteUrl),
}

impl StoreLocation {
    /// `s3://…` is remote; another `scheme://` is refused (not taken for a directory of that
    /// name); anything else is a directory.
    pub fn parse(location: &str) -> Result<Self, UrlError> {
        if location.starts_with("s3://") {
            return RemoteUrl::parse(location).map(Self::Remote);
        }
        if let Some((scheme, _)) = location.split_once("://") {
            if !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(UrlError {
                    location: location.to_owned(),
                    reason: "only s3:// object stores are supported",
                });
            }
        }
        Ok(Self::Local(PathBuf::from(location)))
    }
}

impl std::str::FromStr for StoreLocation {
    type Err = UrlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(dir) => write!(f, "{}", dir.display()),
            Self::Remote(url) => url.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_hostile_ones_are_refused() {
        let url = RemoteUrl::parse("s3://my-bucket/vms/a/").expect("valid");
        assert_eq!(url.bucket, "my-bucket");
        assert_eq!(url.prefix, "vms/a");
        assert_eq!(url.key("index"), "vms/a/index");
        assert_eq!(url.to_string(), "s3://my-bucket/vms/a");
        let root = RemoteUrl::parse("s3://bkt").expect("valid");
        assert_eq!(root.key("index"), "index");
        for bad in [
            "s3://",
            "s3://ab/x",
            "s3://UPPER/x",
            "s3://b_k/x",
            "s3://bucket/../x",
            "s3://bucket/a//b",
            "s3://bucket/./b",
            "s3://bucket/a\nb",
            "http://bucket/x",
        ] {
            assert!(RemoteUrl::parse(bad).is_err(), "{bad} accepted");
        }
        assert!(matches!(
            StoreLocation::parse("/var/lib/store"),
            Ok(StoreLocation::Local(_))
        ));
        assert!(matches!(
            StoreLocation::parse("s3://bucket/p"),
            Ok(StoreLocation::Remote(_))
        ));
        assert!(StoreLocation::parse("gs://bucket/p").is_err());
    }
}
