//! Errors as they are printed: the error, then each of its causes.

/// `err` with all its causes, `a: b: c`: what a binary prints, and what a reply carries, so
/// that no cause is lost on the way.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(next) = cause {
        text.push_str(": ");
        text.push_str(&next.to_string());
        cause = next.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open the store")]
    struct Open(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("resume failed")]
    struct Resume(#[source] Open);

    #[test]
    fn error_chain_names_every_cause_in_order() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        assert_eq!(
            error_chain(&Resume(Open(io))),
            "resume failed: cannot open the store: no such file"
        );
    }

    #[test]
    fn error_chain_of_an_error_without_cause_is_its_message() {
        let io = std::io::Error::other("disk on fire");
        assert_eq!(error_chain(&io), "disk on fire");
    }
}
