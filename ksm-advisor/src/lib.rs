//! ksm-advisor
