-- Argo CD health check for mergepipe.io/MergedSnapshot.
-- Healthy: Ready=True: the operator verified the committed manifest in object storage.
-- Degraded: Ready=False because the manifest is invalid or does not match (hash, plan, outputs, budget).
-- Progressing: anything else (not yet observed, manifest not visible yet).
local hs = {}
local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the mergepipe operator"
  return hs
end
if generation ~= nil and (obj.status.observedGeneration == nil or obj.status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local ready = nil
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if c.type == "Ready" then
      ready = c
    end
  end
end
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
  return hs
end
if generation ~= nil and ready.observedGeneration ~= nil and ready.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Ready condition is from an older generation"
  return hs
end
local reason = ready.reason or ""
local message = ready.message or ""
if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = message
  return hs
end
local terminal = {
  ManifestInvalid = true,
  ManifestHashMismatch = true,
  PlanDigestMismatch = true,
  OutputMismatch = true,
  BudgetExceeded = true,
}
if ready.status == "False" and terminal[reason] then
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
hs.message = reason .. ": " .. message
return hs
