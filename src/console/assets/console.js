// Progressive enhancement only: every page works without it.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  // "Select all" on the reconcile desk.
  for (const all of document.querySelectorAll("input[data-select-all]")) {
    all.addEventListener("change", () => {
      for (const box of document.querySelectorAll("input[name=id]")) box.checked = all.checked;
    });
  }
  // A decision form is sent once: a second click would only be refused.
  for (const form of document.querySelectorAll("form[data-once]")) {
    form.addEventListener("submit", () => {
      for (const button of form.querySelectorAll("button")) button.disabled = true;
    });
  }
});
