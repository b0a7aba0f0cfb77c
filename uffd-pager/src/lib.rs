//! uffd-pager
